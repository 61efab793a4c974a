"""Third-party console lines a user cannot act on, kept off the console: a user sees shardtune's
lines, and a library's warning only where it says something to do. Each entry names why it is
noise; anything not listed here still shows."""

from __future__ import annotations

import contextlib
import logging
import warnings

# loggers whose warnings say nothing a fine-tuning user can act on
QUIET_LOGGERS = {
    # torchao's import tries every prebuilt kernel library (mxfp8, CUTLASS for sm90a) and warns for
    # each that does not load on this machine: it never uses them on a CPU or another GPU
    "torchao": logging.ERROR,
    # torch telling library authors (torchao) that their Enum registrations are no longer needed
    "torch.utils._pytree": logging.ERROR,
    # the Hub client's line per failed try of a request ("'[Errno -2] Name or service not known' thrown
    # while requesting HEAD …"): a retry that works needs nothing, and the last failure is shardtune's one line
    "huggingface_hub.utils._http": logging.ERROR,
}
# (message start, category) of warnings about other libraries' use of an API
QUIET_WARNINGS = [
    # peft asks transformers whether checkpointing is on under the deprecated name
    ("`is_gradient_checkpointing` is deprecated", FutureWarning),
    # torch's ShardedGradScaler (fp16) hands its found-inf tensor, shape [1], to a DTensor op, and
    # torch's DTensor dispatch asks for a scalar: torch's code talking to torch's, in every fp16 step
    # (and plan's fp16 traces)
    ("Found a non-scalar tensor with numel=1 and ndim!=0", UserWarning),
    # peft dropping, by design, the position ids generate() passes to a prompt-tuning model (at every
    # token): the model numbers the positions itself; nothing for a user to change
    ("Position ids are not supported for parameter efficient tuning", UserWarning),
    # peft saving the embedding or head weights with an adapter that targets them (its `save_embedding_layers`
    # switched on for the user): what a user asked for, said as peft's own setting name
    ("Setting `save_embedding_layers` to `True`", UserWarning),
]


def quiet_third_party() -> None:
    """Before the libraries are imported: their loggers are created here with these levels."""
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


@contextlib.contextmanager
def transformers_warnings():
    """Yield a list that collects what transformers logs inside the block (kept off the console):
    a check that builds a model reads what the library says about it."""
    logger = logging.getLogger("transformers")
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers, logger.propagate = [Keep()], False
    logger.setLevel(logging.WARNING)
    try:
        yield said
    finally:
        logger.handlers, logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
