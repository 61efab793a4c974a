"""Third-party lines a user cannot act on stay off the console (noise.py); others still show."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import child_env

PROBE = """
import warnings
warnings.simplefilter("default")  # what a console shows, as outside pytest
{quiet}
import torchao  # noqa: F401  (imports torch; warns for each prebuilt kernel library it cannot load)
# what peft's call of transformers' deprecated property warns (the model itself costs seconds to import)
warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6", FutureWarning)
# what torch's DTensor dispatch warns when torch's ShardedGradScaler hands it its found-inf tensor (fp16)
warnings.warn("Found a non-scalar tensor with numel=1 and ndim!=0, we are implicitly creating a replicated "
              "DTensor for it.", UserWarning)
warnings.warn("Position ids are not supported for parameter efficient tuning. Ignoring position ids.")  # peft's
warnings.warn("Setting `save_embedding_layers` to `True` as embedding layers found in `target_modules`.")  # peft's
warnings.warn("a warning nobody listed")
from huggingface_hub.utils import http_backoff
try:  # the Hub client's line per failed try of a request (port 1: nobody listens, refused at once)
    http_backoff("HEAD", "http://127.0.0.1:1/config.json", max_retries=0)
except Exception:
    pass
"""
NOISE = ("Failed to load", "is an Enum subclass and is now natively supported", "`is_gradient_checkpointing`",
         "Found a non-scalar tensor with numel=1", "thrown while requesting",
         "Position ids are not supported", "Setting `save_embedding_layers`")


def console(quiet: bool) -> str:
    call = "from shardtune.noise import quiet_third_party; quiet_third_party()" if quiet else ""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(quiet=call)], capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_listed_noise_is_gone_and_the_rest_still_shows():
    loud, quiet = console(False), console(True)
    present = [n for n in NOISE if n in loud]
    if not present:
        pytest.skip("this machine's libraries print none of the listed noise")
    assert not [n for n in present if n in quiet], quiet
    assert "a warning nobody listed" in quiet
