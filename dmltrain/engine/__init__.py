"""The engine: setup, the loop, one optimizer step, and what carries the bitwise
promise (state, budgets, precision, NaN agreement, metrics, evaluation)."""
