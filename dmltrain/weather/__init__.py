"""Weather and climate models' training: autoregressive rollouts (``rollout``)."""
