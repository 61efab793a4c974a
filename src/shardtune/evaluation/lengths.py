"""How long `eval`'s blocks and `generate`'s prompts and continuations are, against the positions
of the models they run on. A length the user did not give is the default cut to what the models
hold (and said so); one the user gave that does not fit is refused, naming its option."""

from __future__ import annotations

import dataclasses
import os

from shardtune.errors import UserError

SEQ_LEN = 512  # eval's --seq-len without a run config
NEW_TOKENS = 64  # --max-new-tokens
PROMPT_TOKENS = 32  # eval --generate's --prompt-tokens (text documents)


@dataclasses.dataclass(frozen=True)
class Room:
    """The positions a model leaves for a sequence: its maximum less an adapter's virtual tokens."""
    tokens: int
    spec: str
    virtual: int = 0

    def __str__(self) -> str:
        beside = f" beside its adapter's {self.virtual} virtual tokens" if self.virtual else ""
        return f"the {self.tokens} positions model {self.spec!r} has{beside}"


def room_of(spec: str, hf_config, virtual: int | None = None) -> Room | None:
    """`spec`'s Room (None: no maximum in its config); `virtual`: its virtual tokens (default:
    those of the adapter `spec` names, read without weights)."""
    from shardtune.model.hf import max_positions

    limit = max_positions(hf_config)
    if limit is None:
        return None
    if virtual is None:
        from shardtune.checkpoint.loading import adapter_structure

        virtual = adapter_structure(spec).virtual_tokens
    return Room(limit - virtual, spec, virtual)


def smallest(rooms) -> Room | None:
    """The tightest of the models' rooms (None ones have no maximum); refused below 2 positions."""
    known = [r for r in rooms if r is not None]
    room = min(known, key=lambda r: r.tokens) if known else None
    if room is not None and room.tokens < 2:
        raise UserError(f"{room} leave(s) no room for a prompt and a token after it; use a model with more positions"
                        + (" or fewer virtual tokens" if room.virtual else ""))
    return room


def note(line: str) -> None:
    """A default that was cut, said once (rank 0) with the command's output: stderr stays for errors."""
    if os.environ.get("RANK", "0") == "0":
        print(f"note: {line}", flush=True)


def seq_len(given: int | None, run_seq_len: int | None, room: Room | None, say=note) -> int:
    """eval's block length: --seq-len, else the run's data.seq_len, else SEQ_LEN cut to `room`."""
    if given is not None:
        if room is not None and given > room.tokens:
            raise UserError(f"--seq-len {given} is above {room}; set --seq-len {room.tokens} or less")
        return given
    if run_seq_len is not None:
        if room is not None and run_seq_len > room.tokens:
            raise UserError(f"the run's data.seq_len={run_seq_len} (eval's default --seq-len) is above {room}; "
                            f"pass --seq-len {room.tokens} or less")
        return run_seq_len
    if room is not None and room.tokens < SEQ_LEN:
        say(f"--seq-len {room.tokens}: the default {SEQ_LEN} is above {room}")
        return room.tokens
    return SEQ_LEN


def _fits_new_tokens(given: int, room: Room) -> None:
    if given >= room.tokens:
        raise UserError(f"--max-new-tokens {given} leaves no room for a prompt in {room}; set --max-new-tokens "
                        f"{room.tokens - 1} or less")


def new_tokens(given: int | None, room: Room | None, longest_prompt: int, say=note) -> int:
    """--max-new-tokens for prompts of up to `longest_prompt` tokens (a longer one keeps its end):
    the default NEW_TOKENS cut to what the longest prompt leaves, though never below half the room."""
    if room is None:
        return NEW_TOKENS if given is None else given
    if given is not None:
        _fits_new_tokens(given, room)
        return given
    fit = min(NEW_TOKENS, max(room.tokens - longest_prompt, room.tokens // 2, 1))
    if fit < NEW_TOKENS:
        say(f"--max-new-tokens {fit}: the default {NEW_TOKENS} does not fit beside the prompt in {room}")
    return fit


def prompt_and_new_tokens(prompt: int | None, new: int | None, room: Room | None, say=note) -> tuple[int, int]:
    """(--prompt-tokens, --max-new-tokens) of text documents, whose prompt is exactly that long:
    both must fit in `room` together; a default gives way to a given value."""
    if room is None:
        return PROMPT_TOKENS if prompt is None else prompt, NEW_TOKENS if new is None else new
    if new is not None:
        _fits_new_tokens(new, room)
    if prompt is not None and prompt >= room.tokens:
        raise UserError(f"--prompt-tokens {prompt} leaves no room for new tokens in {room}; set --prompt-tokens "
                        f"{room.tokens - 1} or less")
    if prompt is not None and new is not None and prompt + new > room.tokens:
        raise UserError(f"--prompt-tokens {prompt} plus --max-new-tokens {new} is above {room}; lower either, so "
                        f"that they add up to {room.tokens} or less")
    fitted_prompt = prompt if prompt is not None else min(PROMPT_TOKENS, room.tokens - new if new else room.tokens // 2)
    fitted_new = new if new is not None else min(NEW_TOKENS, room.tokens - fitted_prompt)
    cut = [f"--{name} {value} (default {default})" for name, value, default, given in (
        ("prompt-tokens", fitted_prompt, PROMPT_TOKENS, prompt), ("max-new-tokens", fitted_new, NEW_TOKENS, new))
        if given is None and value < default]
    if cut:
        say(f"{' and '.join(cut)}: what fits in {room}")
    return fitted_prompt, fitted_new
