"""plan.fit's host RAM: a memory cgroup's limit (a Slurm job's --mem, a container's) bounds what is
available, at its own level and every level above it, cgroup v1 and v2, where the machine has more."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from shardtune.plan import fit

GIB = 2 ** 30
LEVEL = st.tuples(st.one_of(st.none(), st.integers(1, 64 * GIB)), st.integers(0, 64 * GIB), st.integers(0, 8 * GIB))
V1_UNLIMITED = "9223372036854771712"


def write_tree(tmp: Path, version: int, levels: list, inside: bool) -> tuple[Path, Path]:
    """A cgroup mount holding the levels (limit or None, usage, inactive file cache), outermost first,
    and the /proc/self/cgroup naming the innermost; not `inside`: a container's view, where the named
    path is the host's and the mount's root is the process's own cgroup (then only the root's level)."""
    root = tmp / "cgroup"
    mount = root if version == 2 else root / "memory"
    names = [f"l{i}" for i in range(1, len(levels))]
    folder = mount
    for i, (limit, usage, inactive) in enumerate(levels):
        if i:
            folder = folder / names[i - 1]
        folder.mkdir(parents=True, exist_ok=True)
        if version == 2:
            (folder / "memory.max").write_text("max\n" if limit is None else f"{limit}\n")
            (folder / "memory.current").write_text(f"{usage}\n")
            (folder / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
        else:
            (folder / "memory.limit_in_bytes").write_text(f"{V1_UNLIMITED if limit is None else limit}\n")
            (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
            (folder / "memory.stat").write_text(f"inactive_file 7\ntotal_inactive_file {inactive}\n")
    path = "/" + "/".join(names) if inside else "/host/slice/job_1"
    membership = tmp / "self_cgroup"
    membership.write_text(f"0::{path}\n" if version == 2 else f"4:memory:{path}\n3:cpuset:/\n1:name=systemd:/x\n")
    return root, membership


@settings(max_examples=60, deadline=None)
@given(version=st.sampled_from([1, 2]), levels=st.lists(LEVEL, min_size=1, max_size=4), inside=st.booleans())
def test_the_headroom_is_the_least_any_level_leaves(tmp_path_factory, version, levels, inside):
    tmp = tmp_path_factory.mktemp("cg")
    root, membership = write_tree(tmp, version, levels, inside)
    seen = levels if inside else levels[:1]
    rooms = [max(0, limit - usage + inactive) for limit, usage, inactive in seen if limit is not None]
    assert fit.cgroup_headroom(str(root), str(membership)) == (min(rooms) if rooms else None)


def test_no_cgroup_file_is_no_limit(tmp_path):
    assert fit.cgroup_headroom(str(tmp_path), str(tmp_path / "absent")) is None
    root, membership = write_tree(tmp_path, 2, [(4 * GIB, GIB, 0)], inside=True)
    (root / "memory.current").write_text("garbled\n")
    assert fit.cgroup_headroom(str(root), str(membership)) is None


def test_a_job_limit_below_the_machines_free_ram_is_what_is_available(monkeypatch):
    monkeypatch.setattr(fit, "cgroup_headroom", lambda *a: None)
    machine = fit.available_host_bytes()
    monkeypatch.setattr(fit, "cgroup_headroom", lambda *a: 3 * GIB)
    assert fit.available_host_bytes() == min(machine, 3 * GIB)
    monkeypatch.setattr(fit, "cgroup_headroom", lambda *a: 10 * machine)
    assert fit.available_host_bytes() == machine
