"""`torchrun --nproc-per-node 2 -m spml_cache extract ...` (gloo, CPU): Ctrl-C keeps every rank's rows and names the
torchrun command that goes on; resuming over another number of processes is refused in one line; the cache it
joins equals the one-process cache row for row."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from cli_support import REPO
from extract_support import random_weights

from spml_cache import cache, datasets, protocol
from spml_cache.demo.data import make_demo_data
from spml_cache.extract import extract
from spml_cache.runtime.errors import SpmlError



def torchrun(*args, cwd, **popen) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SPML_")}
    env.update(PYTHONPATH=str(REPO), COLUMNS="400", OMP_NUM_THREADS="1", SPML_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "spml_cache", *args]
    return subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, **popen)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchrun's CPU processes and a FIFO, as CI has")
def test_two_ranks_interrupted_resumed_equal_one_process(tmp_path, tmp_path_factory):
    weights = random_weights(tmp_path_factory)
    root = make_demo_data(tmp_path / "data", num_train=20, num_test=8, size=40)
    common = ["--root", str(root), "--weights", str(weights), "--resolution", "32", "--batch-size", "2",
              "--workers", "0", "--device", "cpu"]
    out = tmp_path / "two" / "voc.h5"
    shards = [out.with_name(f"voc.h5.shard-{rank}-of-2.partial") for rank in range(2)]
    # Rank 0's third training image becomes a FIFO: reading it blocks until the test writes it, so the run is
    # surely in the middle when it is interrupted.
    train_ids = protocol.apply_protocol(datasets.read("voc", root)).train.ids
    stalled = root / train_ids[4]
    image = stalled.read_bytes()
    stalled.unlink()
    os.mkfifo(stalled)

    first = torchrun("extract", "voc", *common, "--out", str(out), cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not all(path.exists() for path in shards):  # both ranks are extracting
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # rank 0 reaches the FIFO
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: the terminal signals torchrun and every rank
    _, stderr = first.communicate(timeout=60)
    assert first.returncode != 0 and not out.exists(), stderr
    assert all(path.exists() for path in shards)
    line = next(line for line in stderr.splitlines() if line.startswith("interrupted: "))
    assert f"images are kept in {shards[0]} (and the other ranks' in theirs); go on with: torchrun" \
           " --nproc-per-node 2 -m spml_cache extract voc" in line, stderr

    with pytest.raises(SpmlError, match=r"was started by an extraction over 2 processes .* not one process: go on"
                                        r" with torchrun --nproc-per-node 2"):
        extract("voc", root, out=out, weights=str(weights), resolution=32, workers=0, device="cpu")

    stalled.unlink()
    stalled.write_bytes(image)
    second = torchrun("extract", "voc", *common, "--out", str(out), cwd=tmp_path)
    stdout, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    assert stdout.count("written") == 1  # rank 0 reports for both
    assert not any(path.exists() for path in shards)

    single = extract("voc", root, out=tmp_path / "one" / "voc.h5", weights=str(weights), resolution=32,
                     batch_size=2, workers=0, device="cpu").path
    joined, alone = cache.load(out), cache.load(single)
    for split in cache.SPLITS:
        mine, theirs = getattr(joined, split), getattr(alone, split)
        assert mine.ids == theirs.ids
        np.testing.assert_array_equal(mine.labels, theirs.labels)
        if mine.observed is not None:
            np.testing.assert_array_equal(mine.observed, theirs.observed)
        # other batches, other threads: the same rows up to float rounding
        np.testing.assert_allclose(mine.features, theirs.features, rtol=1e-4, atol=1e-4)
    cache.verify(joined)
