"""Fixtures: a local HTTP server, the Slurm cluster, a small disk, the cluster tests'
reference run; the order the modules run in. The helpers the tests import are in
helpers.py."""

import functools
import http.server
import subprocess
import threading
import time

import pytest
from helpers import (
    REQUIRE_ALL,
    TESTS,
    TINY_RUN,
    require,
    run_cli,
)

# tests/run.sh runs modules side by side (pytest-xdist, --dist loadfile: a module's tests
# share one worker, so its module-scoped runs are made once). Much of the suite waits on
# Slurm, timeouts and sleeps while the cores idle; the longest modules start first so that
# none is left running alone at the end. By their durations on a 2-core machine, longest
# first (measured side by side, 4 workers); every other module follows in its usual order.
LONGEST_FIRST = (
    "test_preemption",
    "test_two_nodes",
    "test_mnist",
    "test_benchmarks",
    "test_slurm",
    "test_precision",
    "test_mnist_gan",
    "test_checkpoint",
    "test_distributed",
    "test_mlflow",
    "test_create_env",
    "test_sweep_submit",
    "test_streams",
    "test_bad_input",
    "test_sharding",
    "test_budget",
    "test_tracking",
    "test_checkpointer",
    "test_cli",
    "test_evaluation",
    "test_readme",
    "test_ema",
)


# The quick tier (bash tests/run.sh --quick, under 5 minutes on 2 cores): every module's
# mechanics with no Slurm, MPI or second node. A module's name takes all its tests; a test's
# name (with its parameters, or a prefix of them) takes that one. A test added here should
# cost seconds: CONTRIBUTING.md has the budget.
QUICK = (
    "test_batches.py",
    "test_callback.py",
    "test_config.py",
    "test_data.py",
    "test_docs.py",
    "test_errors.py",
    "test_features.py",
    "test_launch.py",
    "test_metrics.py",
    "test_packaging.py",
    "test_mnist_data.py",
    "test_peers.py",
    "test_preflight.py",
    "test_progress.py",
    "test_schedules.py",
    "test_snapshot.py",
    "test_store.py::test_a_run_saved_to_and_resumed_from_another_store_trains_as_one_never_stopped",
    "test_loop.py",
    "test_gradient_noise.py::test_the_estimate_finds_a_known_noise_scale",
    "test_gradient_noise.py::test_a_window_with_a_non_finite_gradient_is_left_out",
    "test_trainer.py",
    "test_training_log.py",
    "test_zygote.py::test_a_forked_run_trains_as_a_fresh_one",
    "test_zygote.py::test_the_working_directory_its_files_and_the_output_are_the_runs",
    "test_zygote.py::test_a_run_past_its_timeout_is_killed",
    "test_zygote.py::test_another_environment_gets_a_fresh_interpreter",
    "test_bad_input.py::test_checkpoints_that_do_not_load_stop_the_run",
    "test_bad_input.py::test_bad_flags_are_one_line_and_exit_2",
    "test_search.py::test_bad_search_input_is_one_line_before_anything_runs",
    "test_search.py::test_a_journal_holding_another_sweeps_study_is_refused",
    "test_search.py::test_asha_and_hyperband_rungs_fall_at_shares_of_the_trials_steps",
    "test_bad_input.py::test_default_run_directories_never_collide",
    "test_bad_input.py::test_a_yaml_float_without_a_dot_is_read_as_a_number",
    "test_bad_input.py::test_a_status_file_in_a_missing_folder_is_refused_before_training",
    "test_bad_input.py::test_a_rank_that_fails_in_its_own_code_is_named_and_the_run_fails[train",
    "test_budget.py::test_bad_budgets_are_one_line",
    "test_checkpoint.py::test_keep_last_and_best",
    "test_checkpointer.py::test_a_checkpoint_of_an_earlier_version_resumes_bitwise",
    "test_checkpoint.py::test_async_save_writes_a_snapshot_and_reports_failures",
    "test_checkpoint.py::test_wrong_model_names_keys_and_shapes",
    "test_checkpoint.py::test_auto_resume_of_a_different_model_names_the_checkpoint_file",
    "test_checkpoint.py::test_corrupt_latest_falls_back_to_the_previous",
    "test_checkpoint.py::test_best_tracks_the_metric_and_time_based_saves_happen",
    "test_checkpoint.py::test_resume_skips_a_corrupt_latest_and_ends_the_same",
    "test_checkpoint.py::test_async_checkpoints_give_the_same_run",
    "test_checkpoint.py::test_load_weights_for_fine_tuning",
    "test_checkpoint.py::test_contents_load_with_plain_torch_and_no_prefixes",
    "test_checkpoint.py::test_kill_9_during_writes_never_breaks_latest",
    "test_objects.py::test_a_kill_during_an_upload_leaves_latest_whole_and_the_run_resumes_bitwise",
    "test_tiers.py::test_a_node_lost_while_a_checkpoint_drains_resumes_from_the_last_durable_one",
    "test_cli.py::test_config_file_then_flags",
    "test_submit.py::test_slurm_torchrun_script_has_one_task_per_node_and_the_command",
    "test_cli.py::test_boolean_flags_come_in_pairs_and_override_the_config_file",
    "test_cli.py::test_custom_experiment_through_main",
    "test_cli.py::test_bad_input_is_one_line_and_exit_2[args1",
    "test_evaluation.py::test_padding_is_trimmed_and_every_rank_runs_as_many_batches",
    "test_mnist_gan.py::test_two_optimizers_keep_ranks_equal_and_equal_one_process[ddp-manual]",
    "test_mnist_gan.py::test_calling_around_the_ddp_wrapper_is_one_line",
    "test_nan.py::test_nonfinite_is_one_flag_for_many_tensors",
    "test_nan.py::test_raise_stops_every_rank_in_the_same_step[loss]",
    "test_nan.py::test_rollback_from_the_first_steps_uses_the_start_checkpoint",
    "test_precision.py::test_fp16_overflow_is_skipped_and_counted_not_a_nan",
    "test_precision.py::test_clipping_equals_manual_clipping",
    "test_precision.py::test_grad_accumulation_with_a_short_last_group",
    "test_preemption.py::test_handler_only_sets_a_flag",
    "test_preemption.py::test_a_ctrl_c_that_python_dropped_during_start_up_still_stops_the_run",
    "test_preemption.py::test_a_signal_during_start_up_is_acted_on_when_the_run_takes_it_over",
    "test_preemption.py::test_a_short_jobs_early_notice_waits_for_its_own_deadline",
    "test_preemption.py::test_deadline_before_the_time_limit",
    "test_preemption.py::test_the_agreement_comes_every_agreed_number_of_boundaries",
    "test_preemption.py::test_an_agreement_that_costs_more_is_spaced_out_to_one_percent",
    "test_preemption.py::test_sigusr1_then_resume_is_bit_exact[mid-epoch-2]",
    "test_sweep.py::test_a_bad_space_is_refused_with_the_option_named",
    "test_distributed.py::test_spawn_writes_once_from_rank_0",
    "test_distributed.py::test_fsdp",
    "test_distributed.py::test_a_parent_starting_more_nccl_workers_than_its_gpus_is_refused_first",
    "test_streams.py::test_a_stream_trains_with_the_default_loader_each_sample_once_an_epoch",
    "test_zarr_windows.py::test_a_window_is_k_steps_of_every_variable_and_the_target_lead_steps_on",
    "test_zarr_windows.py::test_ranks_share_a_pass_in_turns_each_window_once_and_resume_in_place",
    "test_zarr_windows.py::test_what_it_cannot_read_is_one_line",
    "test_checkpointer.py::test_resume_on_another_number_of_processes_keeps_the_global_batch[2x8->1x8x2]",
    "test_evaluation.py::test_evaluate_is_exact_under_every_strategy[ddp]",
    "test_mnist.py::test_one_epoch_on_the_sample",
    "test_monitor.py::test_the_clock_splits_waiting_for_data_from_train_step",
    "test_processes.py::test_a_class_from_python_stdin_trains_on_two_processes",
    "test_tracking.py::test_offline_run_has_the_config_and_the_logged_metrics",
    "test_watchdog.py::test_a_hang_no_collective_ends_stops_the_run_itself",
    "test_threads.py::test_the_share_of_the_cores",
    "test_threads.py::test_auto_workers_come_from_the_same_share",
    "test_threads.py::test_gpu_processes_with_one_cpu_each_are_warned_of",
    "test_submit.py::test_pbs_asks_four_cpus_a_process_or_the_whole_node",
    "test_processes.py::test_the_open_files_limit_is_raised_to_what_the_site_allows",
    "test_processes.py::test_the_fork_server_leaves_without_the_teardown_of_what_it_preloaded",
    "test_monitor.py::test_an_interval_sends_the_same_few_numbers_whatever_the_number_of_ranks",
    "test_sharding.py::test_settings_that_cannot_run_are_refused_before_any_process_starts",
    "test_sharding.py::test_the_refusal_is_one_line",
    "test_sharding.py::test_a_model_that_needs_real_tensors_names_the_way_out",
    "test_sharding.py::test_recomputed_blocks_draw_the_same_dropout_and_count_each_batch_once",
    "test_profiling.py::test_the_advice_names_sharding_first_when_the_training_state_holds_the_memory",
    "test_sweep_submit.py::test_an_experiment_file_started_as_a_script_sweeps_here",
)


def pytest_collection_modifyitems(items):
    for item in items:
        name = f"{item.path.name}::{item.nodeid.split('::', 1)[1]}"
        if any(name.startswith(q if "::" in q else f"{q}::") for q in QUICK):
            item.add_marker(pytest.mark.quick)

    def rank(item) -> int:
        name = item.module.__name__
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a module's own tests keep their order


@pytest.fixture
def http_dir(tmp_path):
    """Serve a directory on 127.0.0.1; yields (directory, base_url)."""
    root = tmp_path / "served"
    root.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _slurm_up() -> bool:
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(state in out for state in ("idle", "mixed", "allocated"))


@pytest.fixture(scope="session")
def slurm():
    """A running single-node Slurm cluster (started here if it is installed but down)."""
    require("sbatch")
    if not _slurm_up():
        subprocess.run(["bash", str(TESTS / "cluster" / "start_local_slurm.sh")], timeout=120)
    if not _slurm_up():
        message = "the local Slurm cluster did not come up; see /var/log/slurm"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def small_disk(tmp_path):
    """A 40 MB tmpfs (a scratch file system to fill up); needs root, as in CI."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(disk)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        message = f"cannot mount a tmpfs here: {mounted.stderr.strip()}"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """TINY_RUN uninterrupted with 2 processes: what each cluster run must end equal to."""
    run = tmp_path_factory.mktemp("tiny-reference") / "run"
    done = run_cli(*TINY_RUN, "--nprocs", "2", "--run-dir", str(run), cwd=run.parent)
    assert done.returncode == 0, done.stderr
    return run


# ----- object storage (tests/checkpoint/test_objects.py, tests/test_mnist.py) ---------------
class HeldUploads:
    """WSGI layer before moto: while ``hold`` is set, a checkpoint's upload (a PUT under
    checkpoints/ckpt-) is noted (``held``, ``began``) and never reaches the store: the
    upload of a client killed meanwhile."""

    def __init__(self, app) -> None:
        self.app, self.hold, self.held, self.began = app, 0.0, "", threading.Event()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if environ["REQUEST_METHOD"] == "PUT" and "/checkpoints/ckpt-" in path and self.hold:
            self.held = path
            self.began.set()
            time.sleep(self.hold)
            start_response("503 Service Unavailable", [("Content-Length", "0")])
            return [b""]
        return self.app(environ, start_response)


@pytest.fixture(scope="module")
def s3():
    """moto's S3 on a free port of 127.0.0.1 with a bucket ``bucket``; the environment a
    run reaches it with (credentials as every AWS client reads them)."""
    pytest.importorskip("s3fs", reason="the s3 extra (pip install -e .[dev] installs it)")
    import boto3
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_request(self, *args, **kwargs):
            pass

    layer = HeldUploads(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, layer, threaded=True, request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }
    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket="bucket")
    yield env, client, layer
    server.shutdown()
    thread.join()
