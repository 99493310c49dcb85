"""Published training scripts ported to dmltrain (issue #84, point 8): pytorch/examples'
scripts, read from ../shared/ports/ as published, against their ports in tests/ports/.
Each test runs the script itself on the CPU with small settings and saves its final
weights (``runpy``: the script's globals when it ends), then the port: bitwise equal,
uninterrupted and after a SIGUSR1 and a resume.

The ports keep the scripts' model and loss code as it is: each test checks the copied
classes against the script's own text."""

import ast
import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import AT_ONCE, REQUIRE_ALL, ROOT, cli_env, run_cli, signal_at_line

from dmltrain.checkpoint.storage import load_file

PORTS = ROOT.parent / "shared" / "ports"  # beside the checkout in CI; users have none
pytestmark = pytest.mark.skipif(
    not PORTS.is_dir(),
    reason=f"{PORTS} (the published scripts these ports are compared with) is not here",
)
OURS = ROOT / "tests" / "ports"
TORCHVISION = ROOT / "build" / "torchvision"
LOGGED = ["--progress", "log", "--log-every", "1", *AT_ONCE]

# Runs a script as `python script.py ARGS` would, then saves the state_dict of each
# expression named (its models, read from its globals) as they are when it ends.
RUNNER = """
import runpy, sys, torch
script, out, names, vision, seed, prelude, *args = sys.argv[1:]
if vision:
    sys.path.insert(0, vision)
    from ports.vision import torchvision
    torchvision()
if seed:
    torch.manual_seed(int(seed))
exec(prelude)
sys.argv = [script, *args]
found = runpy.run_path(script, run_name="__main__")
torch.save({n: eval(n, found).state_dict() for n in names.split("|") if n}, out)
"""


def run_script(
    script: Path,
    names: str,
    args: list[str],
    cwd: Path,
    vision: bool = False,
    seed: int | None = None,
    prelude: str = "",
    **env: str,
) -> dict:
    """The script's final weights: ``{expression: state_dict}`` for each of ``names``
    (separated by |). ``vision``: it imports torchvision (tests/ports/vision.py says why
    that needs a hand here). ``seed``: torch's generator seeded before the script runs,
    for a script that never seeds. ``prelude``: code run before it."""
    out = cwd / "script-weights.pt"
    shim = str(ROOT / "tests") if vision else ""
    given = "" if seed is None else str(seed)
    command = [sys.executable, "-c", RUNNER, str(script), str(out), names, shim, given, prelude,
               *args]  # fmt: skip
    done = subprocess.run(command,
                          cwd=cwd, env={**cli_env(), **env}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def port_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "latest.pt")["model"]


def assert_equal(script: dict[str, torch.Tensor], port: dict[str, torch.Tensor]) -> None:
    assert list(script) == list(port)
    unequal = [k for k in script if not torch.equal(script[k], port[k])]
    assert not unequal, f"not bitwise equal: {unequal}"


def assert_kept_as_is(script: Path, port: str, *names: str) -> None:
    """The port's copy of each class and function is the script's text, line for line."""

    def defined(path: Path) -> dict[str, str]:
        source = path.read_text()
        nodes = ast.parse(source).body
        return {n.name: ast.get_source_segment(source, n) for n in nodes if hasattr(n, "name")}

    theirs, ours = defined(script), defined(OURS / f"{port}.py")
    for name in names:
        assert ours[name] == theirs[name], name


def vision() -> dict[str, str]:
    """The environment in which a script or port imports torchvision: tests/run.sh installs
    it in build/torchvision, out of the environment (tests/ports/vision.py says why)."""
    if not (TORCHVISION / "torchvision").is_dir():
        message = f"torchvision is not in {TORCHVISION}; tests/run.sh installs it there"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return {"PYTHONPATH": os.pathsep.join([str(TORCHVISION), cli_env()["PYTHONPATH"]])}


def resumed(args: list[str], line: str, cwd: Path, **env: str) -> Path:
    """The port stopped by SIGUSR1 once it prints ``line``, then run again to its end."""
    status, err = signal_at_line([*args, *LOGGED, "--run-dir", "cut"], line, "SIGUSR1", cwd,
                                 **env)  # fmt: skip
    assert status == 3, err[-3000:]
    again = run_cli(*args, "--run-dir", "cut", "--progress", "off", cwd=cwd, **env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from" in again.stdout + again.stderr
    return cwd / "cut"


def sine_waves(path: Path, n: int, length: int) -> None:
    """generate_sine_wave.py's data (its seed and recipe), n waves of ``length`` points
    (the script's 100 x 1000 take minutes a step on 2 cores)."""
    np.random.seed(2)
    t = 20
    x = np.empty((n, length), "int64")
    x[:] = np.array(range(length)) + np.random.randint(-4 * t, 4 * t, n).reshape(n, 1)
    torch.save(np.sin(x / 1.0 / t).astype("float64"), path)


def test_time_sequence_prediction_lbfgs_equals_the_script(tmp_path):
    """LBFGS with a closure (20 evaluations a step), float64, the whole set one batch read
    in order: 3 steps of the script are 3 epochs of the port. A step is the whole epoch,
    so the SIGUSR1 stop falls at an epoch's end, never inside one."""
    script = PORTS / "time_sequence_prediction" / "train.py"
    assert_kept_as_is(script, "time_sequence", "Sequence")
    sine_waves(tmp_path / "traindata.pt", 8, 60)
    # torch >= 2.6 loads weights only by default; the script's file is a pickled array
    theirs = run_script(script, "seq", ["--steps", "3"], tmp_path,
                        TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")["seq"]  # fmt: skip
    args = [str(OURS / "time_sequence.py"), "--epochs", "3"]
    whole = run_cli(*args, "--run-dir", "whole", "--progress", "off", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert_equal(theirs, port_weights(tmp_path / "whole"))
    assert_equal(theirs, port_weights(resumed(args, "epoch 1/3 step 1/1", tmp_path)))


def test_dcgan_on_fake_data_equals_the_script(tmp_path):
    """Two models and two optimizers (manual optimization), detached fakes, the script's
    weight init, fixed noise and shuffled DataLoader, noise drawn each step from torch's
    generator: one epoch of FakeData's 1,000 images in batches of 16, with small nets.
    Stopped by SIGUSR1 in the middle of the epoch, the resume goes on at the next batch,
    with the generator where it was: the same weights, batch norms' statistics included."""
    env = vision()
    script = PORTS / "dcgan" / "main.py"
    assert_kept_as_is(script, "dcgan", "weights_init", "Generator", "Discriminator")
    small = ["--nz", "16", "--ngf", "8", "--ndf", "8"]
    theirs = run_script(script, "netG|netD", ["--dataset", "fake", "--batchSize", "16", *small,
                        "--niter", "1", "--workers", "0", "--manualSeed", "7", "--outf", "out"],
                        tmp_path, vision=True, **env)  # fmt: skip
    theirs = {f"{net}.{k}": v for net, weights in theirs.items() for k, v in weights.items()}
    args = [str(OURS / "dcgan.py"), "--epochs", "1", "--batch-size", "16", *small,
            "--num-workers", "0", "--seed", "7"]  # fmt: skip
    whole = run_cli(*args, "--run-dir", "whole", "--progress", "off", cwd=tmp_path, **env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert_equal(theirs, port_weights(tmp_path / "whole"))
    assert_equal(theirs, port_weights(resumed(args, "epoch 1/1 step 20/63", tmp_path, **env)))


def test_forward_forward_layer_local_training_equals_the_script(tmp_path):
    """Layer-local training: each layer its own Adam and loss, no backward across layers;
    the first layer trains 30 times on one batch, then the second on its outputs. The
    script never seeds: torch 2.13 starts each process from a seed of its own choosing, so
    two runs of the script differ. Given torch.manual_seed(5) before it runs, it equals the
    port's --seed 5 bit for bit, and so does the port stopped in the middle of the first
    layer and resumed (the inputs drawn at the first step come back from the checkpoint)."""
    env = vision()
    script = PORTS / "mnist_forward_forward" / "main.py"
    assert_kept_as_is(script, "forward_forward", "get_y_neg", "overlay_y_on_x", "Net", "Layer")
    raw = tmp_path / "data" / "MNIST" / "raw"  # torchvision's MNIST reads these, unzipped
    raw.mkdir(parents=True)
    for packed in (ROOT / "experiments" / "mnist_sample").glob("*.gz"):
        (raw / packed.stem).write_bytes(gzip.decompress(packed.read_bytes()))
    layers = "torch.nn.ModuleList(net.layers)"  # the script's Net keeps them in a list
    sizes = ["--train_size", "200", "--test_size", "100"]
    theirs = run_script(script, layers, ["--epochs", "30", *sizes], tmp_path, vision=True,
                        seed=5, **env)[layers]  # fmt: skip
    args = [str(OURS / "forward_forward.py"), "--layer-epochs", "30", "--train-size", "200",
            "--test-size", "100", "--seed", "5"]  # fmt: skip
    whole = run_cli(*args, "--run-dir", "whole", "--progress", "off", cwd=tmp_path, **env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert_equal(theirs, port_weights(tmp_path / "whole"))
    assert_equal(theirs, port_weights(resumed(args, "epoch 1/2 step 10/30", tmp_path, **env)))


# The script's FakeData has 1,281,167 images of 224 x 224 (days an epoch on a CPU) and no
# option to say fewer: its class is given smaller sizes before it runs, as the port's
# options give them.
SMALLER = """
import torchvision.datasets as datasets
class Smaller(datasets.FakeData):
    def __init__(self, size, image_size, num_classes, transform):
        super().__init__(64 if size > 60000 else 32, (3, 64, 64), num_classes, transform)
datasets.FakeData = Smaller
"""


def test_imagenet_on_dummy_data_equals_the_script(tmp_path):
    """resnet18, SGD with momentum and weight decay, StepLR, the script's shuffled loader
    and validation by acc@1, 2 epochs of 8 steps on 64 FakeData images of 64 x 64: its
    checkpoint.pth.tar's weights equal the port's bit for bit, uninterrupted and stopped by
    SIGUSR1 in the middle of epoch 2 (after a validation) and resumed.

    Not on 2 processes: on a CPU the script wraps no DDP (it does only on an accelerator),
    so its --multiprocessing-distributed ranks train apart, each on its own shard; and it
    counts one process per node there. The port's ranks average their gradients, as the
    script's do on GPUs."""
    env = vision()
    script = PORTS / "imagenet" / "main.py"
    assert_kept_as_is(script, "imagenet", "accuracy")
    run_script(script, "", ["--dummy", "--epochs", "2", "-b", "8", "-j", "0", "--seed", "3"],
               tmp_path, vision=True, prelude=SMALLER, **env)  # fmt: skip
    theirs = torch.load(tmp_path / "checkpoint.pth.tar", weights_only=True)["state_dict"]
    args = [str(OURS / "imagenet.py"), "--epochs", "2", "--batch-size", "8", "--num-workers",
            "0", "--seed", "3", "--train-samples", "64", "--val-samples", "32",
            "--image-size", "64"]  # fmt: skip
    whole = run_cli(*args, "--run-dir", "whole", "--progress", "off", cwd=tmp_path, **env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert_equal(theirs, port_weights(tmp_path / "whole"))
    assert_equal(theirs, port_weights(resumed(args, "epoch 2/2 step 3/8", tmp_path, **env)))
