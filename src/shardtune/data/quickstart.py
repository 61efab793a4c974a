"""Offline quickstart assets: a corpus and a tokenizer built locally, with no network.

`shardtune train` with no recipe must work on a bare CPU machine, so the data cannot come
from the Hugging Face hub. Python's own docstrings are always installed, are real English
mixed with code, and are the same on every run of a given Python, so they are the corpus.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

# Bump when the corpus recipe or file layout changes, so old caches are not reused.
# 2: documents collected in a fresh interpreter (version 1's depended on what the process had imported)
ASSETS_VERSION = 2
EOS = "<|endoftext|>"
MIN_DOC_CHARS = 40
VALIDATION_EVERY = 20

# Fixed and sorted: pure-Python or always-built modules that import without side effects
# (no windows, no output, no network). Order matters for determinism, so never sort at run time.
CORPUS_MODULES = tuple("""
abc argparse ast asyncio.base_events asyncio.events asyncio.futures asyncio.locks
asyncio.queues asyncio.streams asyncio.tasks base64 bdb builtins calendar cmd code codecs
collections collections.abc compileall configparser contextlib copy csv dataclasses datetime
decimal difflib dis doctest email.charset email.generator email.header email.headerregistry
email.message email.parser email.policy email.utils enum filecmp fileinput fractions ftplib
functools gc getopt graphlib gzip hashlib heapq hmac http.client http.cookiejar http.cookies
http.server imaplib importlib.abc importlib.metadata importlib.util inspect io ipaddress
itertools json json.decoder json.encoder locale logging logging.config logging.handlers
mailbox marshal math mimetypes multiprocessing.managers numbers optparse os pathlib pdb pickle
pickletools pkgutil platform plistlib poplib profile pstats py_compile pyclbr pydoc queue
random re runpy sched selectors shelve shutil smtplib socket socketserver statistics
subprocess symtable sys sysconfig tarfile tempfile textwrap threading time timeit tokenize
trace traceback typing unittest.case unittest.loader unittest.mock urllib.parse urllib.request
uuid warnings weakref wsgiref.handlers wsgiref.validate xml.dom.minidom xml.dom.pulldom
xml.etree.ElementTree xml.sax.handler xml.sax.xmlreader xmlrpc.client xmlrpc.server zipfile
zipimport
""".split())


def default_cache_dir() -> Path:
    """Where quickstart assets live: $SHARDTUNE_CACHE, else the XDG cache, plus "quickstart"."""
    root = os.environ.get("SHARDTUNE_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "shardtune") if xdg else os.path.join(Path.home(), ".cache", "shardtune")
    return Path(root) / "quickstart"


def _members(modname: str, module):
    """(qualified name, object) for the module, its own classes and functions, and their methods."""
    yield modname, module
    for name, obj in vars(module).items():
        # Skip re-exports: each object is documented under the module that defines it.
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or getattr(obj, "__module__", None) != modname:
            continue
        yield f"{modname}.{name}", obj
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if isinstance(value, (classmethod, staticmethod)):
                    value = value.__func__
                if inspect.isroutine(value) or inspect.isdatadescriptor(value):
                    yield f"{modname}.{name}.{attr}", value


def _language_reference() -> list[str]:
    """The language reference pydoc ships, in ~1.5 kB paragraph groups.

    Docstrings alone come to ~1 MB; this adds ~0.5 MB of prose. Optional: a distribution
    may leave pydoc_data out, and the corpus is still usable without it."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    chunks = []
    for key in sorted(topics):
        current = ""
        for para in topics[key].split("\n\n"):
            current = f"{current}\n\n{para}" if current else para
            if len(current) >= 1500:
                chunks.append(current.strip())
                current = ""
        if current.strip():
            chunks.append(current.strip())
    return chunks


def collect_documents() -> list[str]:
    """Deterministic, deduplicated list of documents (one docstring or reference chunk each), the
    same for every process of a given Python: collected in a fresh interpreter without site-packages
    (`-I -S`), because libraries change the standard library they import into (transformers adds
    methods to logging.Logger, others wrap inspect and typing functions), and in a process that had
    imported them the corpus was another (the same Python packed 222 blocks on one GPU machine and
    223 on the next, whose libraries differed).
    Where no such interpreter can be started (a frozen executable), collected here."""
    code = f"import json, runpy, sys; json.dump(runpy.run_path({__file__!r})['_collect_here'](), sys.stdout)"
    try:
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                              timeout=600, check=True)
        return json.loads(proc.stdout)  # noqa: TID251 - our own child's output; this file runs alone there (no imports)
    except (OSError, subprocess.SubprocessError, ValueError):
        return _collect_here()


def _collect_here() -> list[str]:
    docs: list[str] = []
    seen: set[str] = set()

    def add(text):
        if text and len(text) >= MIN_DOC_CHARS and text not in seen:
            seen.add(text)
            docs.append(text)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices from imports are noise here
        for modname in CORPUS_MODULES:
            try:
                module = importlib.import_module(modname)
            except ImportError:  # a stripped-down Python without e.g. zlib: use the rest
                continue
            for _, obj in sorted(_members(modname, module), key=lambda item: item[0]):
                try:
                    add(inspect.getdoc(obj))
                except Exception:  # a broken __doc__ property must not stop the build
                    continue
    for chunk in _language_reference():
        add(chunk)
    if len(docs) < 200:
        raise RuntimeError(f"only {len(docs)} documents for the quickstart corpus; "
                           "Python run with -OO strips docstrings, run it without -OO")
    return docs


def _complete(folder: Path, wanted: dict) -> bool:
    """True when folder holds a finished build for these settings (its marker is written last)."""
    try:
        from shardtune.fsio import json_loads  # not at the top: collect_documents runs this file in a bare Python

        marker = json_loads((folder / ".assets.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and all(marker.get(k) == v for k, v in wanted.items())


def _result(folder: Path) -> dict:
    names = {"train": "train.jsonl", "validation": "validation.jsonl", "tokenizer": "tokenizer"}
    return {k: str(folder.resolve() / v) for k, v in names.items()}


def _train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    # Imported here: these are slow to import and the CLI must start fast.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(  # deterministic: merge ties are broken by token id
        vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # so any byte is encodable
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS,
        model_max_length=1024, clean_up_tokenization_spaces=False)  # keep decode(encode(s)) == s
    wrapped.save_pretrained(str(out_dir))


def build_quickstart_assets(cache_dir: str | Path, vocab_size: int = 2048, max_docs: int | None = None) -> dict:
    """Build (or reuse, if already complete in cache_dir) the quickstart corpus + tokenizer.

    Returns {"train": "<abs path to train.jsonl>", "validation": "<abs path to validation.jsonl>",
             "tokenizer": "<abs path to tokenizer folder>"}.

    Each setting gets its own sub-folder, built in a temp folder and renamed into place with
    the marker already inside, so a reader never sees a half-built folder and two concurrent
    builders cannot corrupt each other: the first rename wins, the loser discards its copy.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + {EOS}), got {vocab_size}")
    cache_dir = Path(cache_dir)
    key = f"v{ASSETS_VERSION}-bpe{vocab_size}" + (f"-docs{max_docs}" if max_docs else "")
    final = cache_dir / key
    wanted = {"version": ASSETS_VERSION, "vocab_size": vocab_size, "max_docs": max_docs}
    if _complete(final, wanted):
        return _result(final)

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", suffix=".tmp", dir=cache_dir))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; a shared cache must stay readable
        docs = collect_documents()[:max_docs] if max_docs else collect_documents()
        train = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY != 0]
        validation = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY == 0]
        for name, split in (("train", train), ("validation", validation)):
            with open(tmp / f"{name}.jsonl", "w", encoding="utf-8") as f:
                for text in split:
                    f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        _train_tokenizer(train, vocab_size, tmp / "tokenizer")
        info = dict(wanted, train_docs=len(train), validation_docs=len(validation),
                    text_bytes=sum(len(d.encode("utf-8")) for d in docs),
                    python=".".join(map(str, sys.version_info[:3])))
        (tmp / ".assets.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")  # last

        if final.exists() and not _complete(final, wanted):
            # Damaged or edited by hand: move it aside, then put ours in its place.
            stale = Path(tempfile.mkdtemp(prefix=f".{key}-", suffix=".stale", dir=cache_dir))
            try:
                os.replace(final, stale / "old")
            except OSError:
                pass  # another process moved it first
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final, wanted):
                raise
            # Another process finished first; its copy is identical, keep it and drop ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _result(final)


def cached_assets() -> dict:
    """The assets in the default cache, whose folder the environment chooses: a cache that cannot
    be written is one line naming SHARDTUNE_CACHE (a HOME that is a file, a folder under /proc)."""
    from shardtune.diskspace import no_room
    from shardtune.errors import UserError

    cache = default_cache_dir()
    try:
        return build_quickstart_assets(cache)
    except OSError as exc:
        if no_room(exc, 0, None) or exc.filename is None:
            raise  # the CLI's handler says a full disk as such
        raise UserError(f"the quickstart's cache {str(cache)!r} cannot be written ({exc.strerror}: "
                        f"{exc.filename}); set SHARDTUNE_CACHE to a folder you can write") from None


def quickstart_defaults(overrides: list[str] = ()) -> tuple[dict, str]:
    """The embedded default run, less what the user's `overrides` replace, and the start-up line
    saying exactly which defaults apply.

    Its parts: the model (a ~0.7M-parameter random-init GPT-2 and its docstring tokenizer), the
    training settings and seq_len sized for that GPT-2, the data (the docstring corpus), and the
    run's shape (eval and log cadence). Naming a model (model.name_or_path) drops the model and its
    training settings; a model.config that names its own model_type (a random-init model of your
    design) drops the GPT-2 and its training settings but keeps the docstring tokenizer unless
    model.tokenizer is given (model.config without a model_type tweaks the quickstart's GPT-2);
    naming data (data.path) drops the data. The assets are built only when used."""
    from shardtune.config.load import parse_override, set_dotted

    named: dict = {}
    for text in overrides:
        set_dotted(named, *parse_override(text))
    own_model = _names(named, "model", "name_or_path")
    own_design = not own_model and _names(named, "model", "config", "model_type")
    own_tokenizer = own_model or _names(named, "model", "tokenizer")
    own_data = _names(named, "data", "path")
    tree: dict = {"eval": {"every_steps": 50, "max_batches": 8}, "log": {"every_steps": 10}}
    assets = cached_assets() if not (own_tokenizer and own_data) else None
    if not own_tokenizer:
        tree["model"] = {"tokenizer": assets["tokenizer"]}
    if not (own_model or own_design):
        tree.setdefault("model", {})["config"] = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4,
                                   "n_positions": 256, "vocab_size": 2048}
        tree["data"] = {"seq_len": 128}
        tree["train"] = {"micro_batch_size": 16, "global_batch_size": 32, "lr": 3e-3, "warmup_steps": 15,
                         "max_steps": 150, "weight_decay": 0.01}
    if not own_data:
        tree.setdefault("data", {})["path"] = str(Path(assets["train"]).parent)
    parts = [("model and training settings (random-init GPT-2)", own_model or own_design),
             ("tokenizer (docstring BPE)", own_tokenizer), ("data (docstring corpus)", own_data)]
    used = [part for part, mine in parts if not mine]
    yours = [part for part, mine in (("model", own_model), ("model.config's model and shardtune's training "
                                                            "settings", own_design), ("data", own_data)) if mine]
    return tree, (f"quickstart defaults: {', '.join(used + ['eval and log cadence'])}"
                  + (f"; your {' and '.join(yours)} replace the quickstart's" if yours else ""))


def _names(tree: dict, section: str, *keys: str) -> bool:
    """True when the overrides give `section.key[.key...]` a value (directly or as part of the section)."""
    node = tree.get(section)
    for key in keys:
        node = getattr(node, "parsed", node)
        if not isinstance(node, dict):
            return False
        node = node.get(key)
    return node is not None
