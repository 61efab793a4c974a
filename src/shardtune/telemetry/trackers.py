"""Experiment trackers beside the always-on metrics.jsonl: TensorBoard, W&B, MLflow.

Only rank 0 logs. W&B honours WANDB_MODE (offline works without network); MLflow writes to
MLFLOW_TRACKING_URI, or to a local file store in the run folder when that is unset. A resumed run
continues the W&B and MLflow runs its earlier attempt started (their ids in RUN_IDS), as
TensorBoard continues its folder: one run in the tracker's UI, not one per attempt.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from shardtune.errors import UserError

HISTOGRAM_TRACKERS = {"tensorboard", "wandb"}  # MLflow logs no histograms
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
SETTINGS = {"tensorboard": "the run folder", "wandb": "WANDB_MODE, WANDB_API_KEY, WANDB_BASE_URL, log.project",
            "mlflow": "MLFLOW_TRACKING_URI, log.project"}  # where a tracker that fails to start is set up
WANDB_ONLINE = ("online", "run", "shared")  # W&B's modes that talk to its server (offline/dryrun: files; disabled)
WANDB_LOGIN = "run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline to log to the run folder"
RUN_IDS = "trackers.json"  # in the run folder: {"wandb": run id, "mlflow": run id} of the trackers' runs


def _require(module: str, tracker: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"log.trackers includes {tracker} but {module!r} is not installed; "
                        f"pip install 'shardtune[{EXTRAS[tracker]}]'") from None


def wandb_settings() -> tuple[str, str]:
    """(mode, server) as wandb.init reads them: WANDB_MODE and WANDB_BASE_URL, else what `wandb
    offline` or `wandb login --host` saved in W&B's settings file, else wandb's defaults. They are
    loaded here (once per process, as wandb.init loads them): a WANDB_* value wandb refuses is refused."""
    try:
        from wandb.sdk import wandb_setup

        load = wandb_setup.singleton
    except (ImportError, AttributeError):  # a wandb without this layout: the environment's alone
        return os.environ.get("WANDB_MODE", "online"), os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:
        settings = load().settings
    except ValueError as exc:  # pydantic's refusal of a WANDB_* value (WANDB_MODE, WANDB_BASE_URL, ...)
        raise UserError(f"log.trackers: wandb refuses its settings ({_reason(exc)}); fix them ({SETTINGS['wandb']})"
                        " or drop wandb from log.trackers") from None
    return os.environ.get("WANDB_MODE") or settings.mode, settings.base_url


def wandb_key_found(host: str) -> bool:
    """Whether wandb.init online finds credentials for `host`, searched as it searches (and nothing
    asked): WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE, else the netrc entry `wandb login` wrote
    (NETRC, else ~/.netrc), else an API key in W&B's settings. Without a terminal wandb.init
    refuses a run without them; in one it stops to ask: either once the model is built."""
    try:
        from wandb.sdk.lib.wbauth import authenticate_session

        return authenticate_session(host=host, source="shardtune", prompt=False, update_session=False) is not None
    except (ImportError, TypeError):  # a wandb without this internal call as 0.31 has it: the documented places
        from requests.utils import get_netrc_auth

        return bool(os.environ.get("WANDB_API_KEY") or get_netrc_auth(host))


def check_wandb() -> None:
    """W&B's settings, and online its credentials, as wandb.init will take them."""
    mode, host = wandb_settings()
    if mode not in WANDB_ONLINE:
        return
    from wandb.errors import Error as WandbError

    try:
        found = wandb_key_found(host)
    except (WandbError, ValueError) as exc:  # wandb's refusal of what it found: a malformed key or host, two kinds
        raise UserError(f"log.trackers: wandb refuses its credentials for {host} ({_reason(exc)}); "
                        f"{WANDB_LOGIN}") from None
    if not found:
        raise UserError(f"log.trackers: wandb logs online to {host} but finds no API key; {WANDB_LOGIN}, or drop "
                        "wandb from log.trackers")


def _reason(exc: Exception) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__  # pydantic's reason is on later lines


def servers(names: list[str]) -> list[tuple[str, str, str]]:
    """(tracker, URL, what to do when it does not answer) for each tracker that will talk to a server as
    `Trackers` starts it: MLflow at an http(s) MLFLOW_TRACKING_URI, W&B online at its host."""
    found = []
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if "mlflow" in names and uri.lower().startswith(("http://", "https://")):
        found.append(("mlflow", uri, "start the server or fix MLFLOW_TRACKING_URI"))
    if "wandb" in names and (wandb := wandb_settings())[0] in WANDB_ONLINE:
        found.append(("wandb", wandb[1],
                      "check the network or WANDB_BASE_URL, or set WANDB_MODE=offline to log to the run folder"))
    return found


def tracker_folder(name: str, out: Path) -> Path | None:
    """The folder a tracker writes into inside the run folder (MLflow's only as the local store)."""
    if name == "mlflow":
        return None if "MLFLOW_TRACKING_URI" in os.environ else out / "mlruns"
    return out / name


def check_trackers(names: list[str], timeout: float = 5.0, out: Path | None = None) -> None:
    """Before anything is built: each tracker installed, its folder in the run folder `out` not a
    file, W&B's settings and credentials, and each tracker's server answering at all (any HTTP
    status will do). The clients themselves retry an unreachable server for minutes (MLflow ~4,
    W&B 1.5) and only once the model is built and the data read."""
    import urllib.error
    import urllib.request

    for name in names:
        _require(EXTRAS[name], name)
        folder = tracker_folder(name, out) if out is not None else None
        if folder is not None and os.path.lexists(folder) and not folder.is_dir():
            raise UserError(f"log.trackers: {name} writes into {str(folder)!r}, which is a file; move that file "
                            f"away, choose another output_dir, or drop {name} from log.trackers")
    if "wandb" in names:
        check_wandb()
    for name, url, fix in servers(names):
        try:
            urllib.request.urlopen(url, timeout=timeout).close()
        except urllib.error.HTTPError:
            continue  # it answered
        except (OSError, ValueError) as exc:  # URLError, a timeout, a malformed URL
            why = getattr(exc, "reason", None) or exc
            raise UserError(f"log.trackers: the {name} server {url} does not answer ({why}); {fix}, or drop {name} "
                            "from log.trackers") from None


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def mlflow_names(scalars: dict) -> dict:
    """MLflow's file store keeps a metric as a file named by its key: `grad_norm` and log.watch's
    `grad_norm/h.0` (a file in a folder `grad_norm`) cannot both be, so MLflow gets `grad_norm.h.0`."""
    return {key.replace("/", "."): value for key, value in scalars.items()}


def mlflow_params(hparams: dict) -> dict:
    """The config as MLflow's parameters, each cut at MLflow's own limits (it refuses the whole batch
    past them): a fixed 500 characters cut chat templates, instruct templates and file lists that
    MLflow keeps whole (6,000 since 2.x)."""
    try:
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH as keys
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as values
    except ImportError:  # a client without them: the oldest limits
        keys, values = 250, 500
    return {k[:keys]: str(v)[:values] for k, v in hparams.items()}


class Sink(NamedTuple):
    log: Callable[[dict, int], object]  # (scalars, step)
    close: Callable[[], object]
    artifact: Callable[[Path, str, str, list], object] | None = None  # (folder, name, type, aliases)
    histograms: Callable[[dict, int], object] | None = None  # ({tag: Histogram}, step)


class Histogram(NamedTuple):
    """One histogram of values (log.watch's per block), as the trackers take it."""

    low: float  # -max |value|
    high: float  # max |value|
    counts: list  # BINS equal bins over [low, high]
    sum: float
    sum_squares: float

    def edges(self) -> list[float]:
        width = (self.high - self.low) / len(self.counts)
        return [self.low + i * width for i in range(len(self.counts) + 1)]


def wandb_artifact(run, how: str):
    """`publish.wandb_artifacts`: log a folder as a W&B artifact, by reference to the local files
    (file:// URIs, not read again: checksum off) or uploaded (staged by W&B, then sent)."""
    import wandb

    def log(folder: Path, name: str, kind: str, aliases: list) -> None:
        art = wandb.Artifact(name, type=kind, metadata={"folder": str(folder)})
        if how == "reference":
            art.add_reference(Path(folder).resolve().as_uri(), checksum=False)
        else:
            art.add_dir(str(folder))
        run.log_artifact(art, aliases=aliases)

    return log


def _point_mlflow(mlflow, out: Path) -> None:
    """MLflow at MLFLOW_TRACKING_URI, else at a file store in the run folder. mlflow.set_tracking_uri
    also exports its URI as MLFLOW_TRACKING_URI (for its subprocesses): the user's environment is put
    back, or every later run of this process (a notebook, a library caller) would log into this one's folder."""
    user_uri = os.environ.get("MLFLOW_TRACKING_URI")
    if user_uri is None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # local files: no server needed
    try:  # set each time: an earlier run of this process set its own
        mlflow.set_tracking_uri(user_uri or tracker_folder("mlflow", out).resolve().as_uri())
    finally:
        if user_uri is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)


def _mlflow_run_exists(mlflow, run_id: str) -> bool:
    try:
        mlflow.get_run(run_id)
    except Exception:  # noqa: BLE001 - MLflow's own "not found" (the store moved, the run deleted)
        return False
    return True


class Trackers:
    """Fan-out of scalar metrics to the configured trackers."""

    def __init__(self, names: list[str], out: Path, config: dict, project: str, run_name: str,
                 enabled: bool = True, artifacts: str = "none", start_step: int = 0):
        self.sinks, self.run_name, self.start_step = [], run_name, start_step
        if not enabled:
            return
        self.ids_file = out / RUN_IDS
        self.ids = self._earlier_ids() if start_step else {}
        hparams = flatten(config)
        for name in names:
            try:
                self._start(name, out, hparams, project, run_name, artifacts)
            except Exception as exc:  # noqa: BLE001 - the tracker's own refusal of its settings (a bad WANDB_MODE or URI)
                self.close()
                if isinstance(exc, UserError):
                    raise
                raise UserError(f"log.trackers: {name} could not start ({type(exc).__name__}: {_reason(exc)}); "
                                f"fix its settings ({SETTINGS[name]}) or drop {name} from log.trackers") from None

    def _earlier_ids(self) -> dict:
        """The tracker runs the earlier attempt of this run started (a damaged file: none)."""
        from shardtune.fsio import json_loads

        try:
            ids = json_loads(self.ids_file.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}

    def _started(self, name: str, run_id: str) -> None:
        import json

        from shardtune.fsio import write_text_atomic

        self.ids[name] = run_id
        write_text_atomic(self.ids_file, json.dumps(self.ids))

    def _start(self, name: str, out: Path, hparams: dict, project: str, run_name: str, artifacts: str) -> None:
        if name == "tensorboard":
            _require("tensorboard", name)
            from torch.utils.tensorboard import SummaryWriter

            # a resume hides what the earlier attempt logged after its checkpoint: those steps are trained again
            purge = self.start_step + 1 if self.start_step else None
            writer = SummaryWriter(log_dir=str(tracker_folder(name, out)), purge_step=purge)
            writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in hparams.items()))
            def add_scalars(scalars: dict, step: int, w=writer) -> None:
                for key, value in scalars.items():
                    w.add_scalar(key, value, step)

            def add_histograms(histograms: dict, step: int, w=writer) -> None:
                for tag, h in histograms.items():
                    w.add_histogram_raw(tag, h.low, h.high, sum(h.counts), h.sum, h.sum_squares,
                                        h.edges()[1:], h.counts, step)

            self.sinks.append(Sink(add_scalars, writer.close, histograms=add_histograms))
        elif name == "wandb":
            wandb = _require("wandb", name)
            # WANDB_MODE as it is now (wandb reads its variables once per process), else W&B's settings
            # file's (`wandb offline`), as check_wandb read them
            earlier = self.ids.get("wandb")  # a resume: the same W&B run, its later steps logged again
            run = wandb.init(project=project, name=run_name, dir=str(out), config=hparams,
                             mode=os.environ.get("WANDB_MODE"), id=earlier, resume="allow" if earlier else None)
            self._started("wandb", run.id)
            self.sinks.append(Sink(lambda scalars, step, r=run: r.log(scalars, step=step), run.finish,
                                   wandb_artifact(run, artifacts) if artifacts != "none" else None,
                                   lambda hists, step, r=run, w=wandb: r.log(
                                       {tag: w.Histogram(np_histogram=(h.counts, h.edges()))
                                        for tag, h in hists.items()}, step=step)))
        elif name == "mlflow":
            mlflow = _require("mlflow", name)
            _point_mlflow(mlflow, out)
            mlflow.set_experiment(project)
            earlier = self.ids.get("mlflow")
            if earlier and _mlflow_run_exists(mlflow, earlier):  # a resume: the same run (its params stand)
                mlflow.start_run(run_id=earlier)
            else:
                mlflow.start_run(run_name=run_name)
                mlflow.log_params(mlflow_params(hparams))
            self._started("mlflow", mlflow.active_run().info.run_id)
            self.sinks.append(Sink(lambda scalars, step, m=mlflow: m.log_metrics(mlflow_names(scalars), step=step),
                                   mlflow.end_run))

    def log(self, metrics: dict, step: int) -> None:
        scalars = {k: float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for sink in self.sinks:
            sink.log(scalars, step)

    def histograms(self, histograms: dict, step: int) -> None:
        """log.watch's per-block histograms, to the trackers that take them."""
        for sink in self.sinks:
            if sink.histograms is not None:
                sink.histograms(histograms, step)

    def artifact(self, folder: Path, step: int, final: bool) -> None:
        """A checkpoint (or the final model) as an artifact of the trackers that keep them,
        aliased `latest` (W&B adds it) and `step-N` (and `final`)."""
        name = f"{self.run_name}-{'model' if final else 'checkpoint'}"
        aliases = [f"step-{step}", "latest"] + (["final"] if final else [])
        for sink in self.sinks:
            if sink.artifact is not None:
                sink.artifact(Path(folder), name, "model" if final else "checkpoint", aliases)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
