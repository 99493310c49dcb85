"""Checkpoints in object storage (dmltrain/checkpoint/objects.py) against a real
S3-compatible server: moto's, which s3fs's own tests use, served here on 127.0.0.1 with
its requests going through a small WSGI layer that can hold a checkpoint's upload.

A run preempted mid-epoch and resumed from ``s3://bucket/run`` on "another machine" (its
local records folder gone) ends bitwise equal to a run never stopped; so does one killed
with SIGKILL while a checkpoint uploads, whose ``latest`` names a complete checkpoint all
the while. A missing bucket, missing credentials and a sharded checkpoint are one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
from helpers import AT_ONCE, RANDOM, TINY, assert_same_run, cli_env, run_cli

from dmltrain.checkpoint.objects import mirror


def objects(client, prefix: str) -> dict[str, bytes]:
    found = client.list_objects_v2(Bucket="bucket", Prefix=prefix).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket="bucket", Key=o["Key"])["Body"].read()
            for o in found}  # fmt: skip


def latest(client, run: str) -> str:
    key = f"{run}/checkpoints/latest"
    return json.loads(client.get_object(Bucket="bucket", Key=key)["Body"].read())["checkpoint"]


def loads(client, key: str) -> dict:
    body = client.get_object(Bucket="bucket", Key=key)["Body"].read()
    import io

    return torch.load(io.BytesIO(body), weights_only=True)


def test_a_run_preempted_mid_epoch_resumes_from_s3_on_another_machine_bitwise(s3, tmp_path):
    env, client, _ = s3
    args = [*TINY, *RANDOM, "--keep-last", "2"]
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uri = "s3://bucket/preempted"
    stop = ["--signal-rank", "0", "--signal-at-step", "17", *AT_ONCE]  # 5 steps into epoch 2
    cut = run_cli(*args, "--run-dir", uri, *stop, cwd=tmp_path, **env)
    assert cut.returncode == 3, cut.stderr[-3000:]  # checkpoint saved, more to do
    assert "dmltrain: checkpoints in s3://bucket/preempted/checkpoints" in cut.stdout
    stored = objects(client, "preempted/")
    assert latest(client, "preempted") == "ckpt-000002-00000018.pt"
    assert {"preempted/training_log.csv", "preempted/config.yaml"} <= set(stored)
    local = tmp_path / mirror(uri)
    assert not list(local.glob("checkpoints/*.pt"))  # uploaded, not kept here
    shutil.rmtree(tmp_path / "runs")  # another machine: the records come from the store
    again = run_cli(*args, "--run-dir", uri, cwd=tmp_path, **env)
    assert again.returncode == 0, again.stderr[-3000:]
    said = "dmltrain: resuming from s3://bucket/preempted/checkpoints/ckpt-000002-00000018.pt"
    assert said in again.stdout
    assert_same_run(tmp_path / "whole", local)
    kept = sorted(k for k in objects(client, "preempted/checkpoints/") if "/ckpt-" in k)
    assert kept == ["preempted/checkpoints/ckpt-000002-00000024.pt",
                    "preempted/checkpoints/ckpt-000003-00000036.pt"]  # fmt: skip
    log = objects(client, "preempted/")["preempted/training_log.csv"].decode()
    assert len(log.strip().splitlines()) == 4  # the header and 3 epochs, copied at the end
    assert "testing" not in (local / "config.yaml").read_text()


def test_a_kill_during_an_upload_leaves_latest_whole_and_the_run_resumes_bitwise(s3, tmp_path):
    """A save every 4 steps; once the first is published the next upload is held, and the
    process is killed (SIGKILL) while it waits: no object of it exists, and ``latest``
    names the one before, which loads."""
    env, client, layer = s3
    args = [*TINY, *RANDOM, "--checkpoint-every-steps", "4", "--step-sleep", "0.05"]
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uri, run = "s3://bucket/killed", "killed"
    command = [sys.executable, "-m", "dmltrain", *args, "--run-dir", uri]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=cli_env(**env), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not objects(client, f"{run}/checkpoints/latest") and time.monotonic() < deadline:
            time.sleep(0.02)
        layer.began.clear()
        layer.hold = 20.0  # the next checkpoint's upload waits, and never arrives
        assert layer.began.wait(60), "no upload began"
        process.send_signal(signal.SIGKILL)
        assert process.wait(30) == -signal.SIGKILL
    finally:
        layer.hold = 0.0
        process.kill()
        process.wait()
    names = sorted(k.rsplit("/", 1)[-1] for k in objects(client, f"{run}/checkpoints/"))
    held = layer.held.rsplit("/", 1)[-1]
    assert held.startswith("ckpt-") and held not in names, (held, names)
    pointed = latest(client, run)
    assert pointed in names and pointed < held, (pointed, held, names)
    assert "model" in loads(client, f"{run}/checkpoints/{pointed}")
    again = run_cli(*args, "--run-dir", uri, cwd=tmp_path, **env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {uri}/checkpoints/{pointed}" in again.stdout
    assert_same_run(tmp_path / "whole", tmp_path / mirror(uri))


def test_a_wrong_bucket_missing_credentials_and_shards_are_one_line(s3, tmp_path):
    env, _, _ = s3
    lines = {
        "--run-dir s3://nobucket/run: the bucket nobucket does not exist; create it first":
            (["--run-dir", "s3://nobucket/run"], env),
        "cannot reach s3://bucket/nokeys: no credentials (Unable to locate credentials); set "
        "them in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)":
            (["--run-dir", "s3://bucket/nokeys"],
             {**env, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}),
        "s3://bucket/...: a URI must not hold a password; put the credentials in the "
        "environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)":
            (["--run-dir", "s3://key:secret@bucket/run"], env),
        "sharded checkpoints cannot be written to s3://bucket/sharded/checkpoints (object "
        "storage): pass --checkpoint-format full (rank 0 gathers the whole model), or a "
        "--run-dir on a file system":
            (["--run-dir", "s3://bucket/sharded", "--checkpoint-format", "sharded"], env),
        "checkpoint s3://bucket/none/ckpt.pt does not exist":
            (["--load-weights", "s3://bucket/none/ckpt.pt", "--run-dir", "local"], env),
    }  # fmt: skip
    for line, (args, environment) in lines.items():
        done = run_cli(*TINY, *args, cwd=tmp_path, **environment)
        assert done.returncode in (1, 2), done.stderr[-3000:]
        errors = [x for x in done.stderr.splitlines() if "error" in x]
        assert errors and errors[-1].endswith(line), done.stderr[-3000:]
        assert "secret" not in done.stdout + done.stderr
    assert not os.path.exists(tmp_path / "s3:")  # a URI is never a local folder


def test_weights_evaluation_and_plots_from_a_uri_and_file_uris_are_local_paths(s3, tmp_path):
    env, _, _ = s3
    first = run_cli(*TINY, "--epochs", "1", "--run-dir", "s3://bucket/source", cwd=tmp_path, **env)
    assert first.returncode == 0, first.stderr[-3000:]
    uri = "s3://bucket/source/checkpoints/ckpt-000001-00000012.pt"
    tuned = run_cli(*TINY, "--epochs", "1", "--load-weights", uri, "--run-dir",
                    f"file://{tmp_path}/tuned", cwd=tmp_path, **env)  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert f"dmltrain: weights from {uri} (dmltrain checkpoint): loaded" in tuned.stdout
    assert (tmp_path / "tuned" / "checkpoints" / "latest.pt").is_file()  # file://: a path
    scored = run_cli(*TINY, "--evaluate", uri, "--run-dir", "scored", cwd=tmp_path, **env)
    assert scored.returncode == 0, scored.stderr[-3000:]
    metrics = json.loads((tmp_path / "scored" / "eval_metrics.json").read_text())
    log = (tmp_path / mirror("s3://bucket/source") / "training_log.csv").read_text()
    assert float(log.splitlines()[1].split(",")[3]) == metrics["val_loss"]  # its weights
    elsewhere = tmp_path / "elsewhere"  # another machine: the records come from the store
    elsewhere.mkdir()
    plotted = run_cli("plot", "s3://bucket/source", cwd=elsewhere, **env)
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert (elsewhere / mirror("s3://bucket/source") / "training_curves.png").is_file()


def test_an_outage_keeps_the_checkpoints_here_and_the_run_ends_saying_so(s3, tmp_path):
    """Every upload fails: each checkpoint is kept in the local records folder (the line
    says where, and that the store did not answer), the job ends with status 2 naming
    them; the next job on this machine uploads the newest and goes on from it."""
    env, client, layer = s3
    args = [*TINY, *RANDOM, "--checkpoint-every-steps", "8"]
    whole = run_cli(*args, "--run-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uri = "s3://bucket/outage"
    layer.hold = 0.001  # every checkpoint's PUT answered 503
    try:
        down = run_cli(*args, "--run-dir", uri, cwd=tmp_path, **env)
    finally:
        layer.hold = 0.0
    assert down.returncode == 2, down.stderr[-3000:]
    local = mirror(uri) / "checkpoints"  # relative to the working folder, as said
    assert (
        "cannot upload checkpoint s3://bucket/outage/checkpoints/ckpt-000001-00000008.pt"
        in down.stderr
        and f"it is kept at {local}/ckpt-000001-00000008.pt" in down.stderr
    )
    assert "no checkpoint was written yet" not in down.stderr
    (line,) = [x for x in down.stderr.splitlines() if "could not be uploaded" in x]
    assert "ckpt-000003-00000036.pt" in line and f"are only in {local}" in line, line
    assert not [k for k in objects(client, "outage/checkpoints/") if "/ckpt-" in k]
    again = run_cli(*args, "--run-dir", uri, cwd=tmp_path, **env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ckpt-000003-00000036.pt, kept here when its upload failed, is uploaded now" \
        in again.stderr  # fmt: skip
    assert latest(client, "outage") == "ckpt-000003-00000036.pt"
    assert not list((tmp_path / local).glob("ckpt-*.pt"))
    assert_same_run(tmp_path / "whole", tmp_path / mirror(uri))


def test_a_second_machine_is_refused_while_the_first_holds_the_run(s3, tmp_path):
    """Two machines (two working folders) on one s3:// run: the second is refused while
    the first renews its lock, and nothing of the first's is overwritten; a lock no one
    renews (a job killed) is taken over. A garbage ``latest`` falls back to the names."""
    env, client, _ = s3
    args = [*TINY, "--epochs", "2", "--step-sleep", "0.1", "--checkpoint-every-steps", "4"]
    uri = "s3://bucket/shared"
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    command = [sys.executable, "-m", "dmltrain", *args, "--run-dir", uri]
    process = subprocess.Popen(command, cwd=first, env=cli_env(**env), text=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not objects(client, "shared/checkpoints/latest"):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        refused = run_cli(*args, "--run-dir", uri, cwd=second, **env)
        assert process.poll() is None  # still running: the refusal was made while it held
    finally:
        _, errors = process.communicate(timeout=120)
    assert process.returncode == 0, errors[-3000:]
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"--run-dir {uri} is in use by another job" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert "shared/lock" not in objects(client, "shared/")  # released at its end
    log = objects(client, "shared/")["shared/training_log.csv"].decode()
    assert len(log.strip().splitlines()) == 3  # the first run's 2 epochs, whole
    stale = {"owner": "4242", "host": "elsewhere", "pid": 1, "beat": time.time() - 600}
    client.put_object(Bucket="bucket", Key="shared/lock", Body=json.dumps(stale).encode())
    client.put_object(Bucket="bucket", Key="shared/checkpoints/latest", Body=b"garbage")
    again = run_cli(*args, "--epochs", "3", "--run-dir", uri, cwd=second, **env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "shared/checkpoints/latest names no checkpoint" in again.stderr
    assert "resuming from s3://bucket/shared/checkpoints/ckpt-000002-" in again.stdout
