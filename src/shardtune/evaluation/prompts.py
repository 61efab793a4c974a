"""`shardtune generate`'s prompts laid out as the run trained on them: to an instruct run a prompt
is the instruction, in the run's prompt layout (its data.template, else the alpaca one); to a chat
run, a user turn, rendered by the run's chat template with the generation prompt. A model that
only ever saw its training layout answers a bare question poorly, so that is the default for a
run; `--format text` sends the prompts as they are."""

from __future__ import annotations

from shardtune.errors import UserError


def layout(fmt: str | None, run_cfg):
    """The data config whose format lays out the examples: the run's (with its fields, template and
    chat template), or a default one of `fmt` (--format) where that differs or there is no run: the
    run's template and fields were written for rows of its own format."""
    import dataclasses

    from shardtune.config.schema import DataConfig

    if run_cfg is not None and fmt in (None, run_cfg.data.format):
        return dataclasses.replace(run_cfg.data)
    return DataConfig(format=fmt or "text")


def check_chat(cfg, tokenizer) -> None:
    """eval and generate in the chat format need a chat template: the run's (data.chat_template, or
    the one its tokenizer was saved with), else the tokenizer's own; one line naming --format where
    there is none (these commands have no data.chat_template to set)."""
    if cfg.format == "chat" and not cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError("--format chat lays examples out with the tokenizer's chat template, and this model's "
                        "tokenizer has none; choose --format instruct or text")


def rendered(prompts: list[str], cfg, tokenizer) -> list[tuple[str, list[int]]]:
    """(the text the model is given, its token ids) for each prompt, in `cfg`'s format; the ids
    are training's (a llama-style BOS included), so the prompt reads exactly as in training."""
    from shardtune.config.validation import template_columns
    from shardtune.data import chat, formats

    if cfg.format == "text":
        bos = formats.leading_bos(tokenizer)  # every training document started with it
        return [(p, formats.text_ids(tokenizer, p, bos)) for p in prompts]
    if cfg.format == "instruct":
        fills = {cfg.instruction_field, cfg.input_field}
        if cfg.template is not None and not set(template_columns(cfg.template)) <= fills:
            raise UserError(f"the run's data.template {cfg.template!r} fills columns a prompt cannot give "
                            f"(a prompt is its {cfg.instruction_field!r}); pass --format text with the prompts "
                            "already laid out")
        rows = [{cfg.instruction_field: p, cfg.input_field: ""} for p in prompts]
        return [(formats.instruct_prompt(cfg, r), formats.instruct_prompt_ids(cfg, tokenizer, r)) for r in rows]
    check_chat(cfg, tokenizer)
    chat.check_chat_template(cfg, tokenizer)  # installs the run's data.chat_template
    out = []
    for index, p in enumerate(prompts):
        text = chat.chat_prompt(tokenizer, [{"role": "user", "content": p}], index)
        out.append((text, tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out

