"""Which tests share a pytest-xdist worker: a test module runs on one worker, so its module-scoped fixtures
(worker groups, engines, trained models) are built once; every test that starts Ray (marked `ray`) runs on
one worker, one after another, as two Ray instances side by side on a 2-core machine slow each other past
their tests' timeouts.

xdist's own `--dist loadgroup` reads `xdist_group` marks by rewriting each test's id, which pytest 9 no
longer lets a plugin do; so the workers write each test's group to a file (`record_groups`, named by the
controller in `ENV`) and the controller's scheduler (`GroupScheduling`) reads it. Tests keep their ids.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

ENV = "HYBRIDFLOW_XDIST_GROUPS"  # the file the workers write, set by the controller before they start


def group_of(item: pytest.Item) -> str:
    """The group of a test: `ray`, an explicit `xdist_group` mark's name, or its module's path."""
    if item.get_closest_marker("ray"):
        return "ray"
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    return item.nodeid.split("::")[0]


def name_groups_file(config: pytest.Config) -> None:
    """On the xdist controller: where the workers will write the groups (removed in `forget_groups_file`)."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[ENV] = str(Path(tempfile.gettempdir(), f"hybridflow-xdist-groups-{os.getpid()}.json"))


def forget_groups_file() -> None:
    path = os.environ.pop(ENV, None)
    if path is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(path).unlink(missing_ok=True)


def record_groups(items: list[pytest.Item]) -> None:
    """On a worker: writes `{test id: group}` where the controller reads it (every worker collects the
    same tests, so each writes the same map; the rename makes each write whole)."""
    path = os.environ.get(ENV)
    if path is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    target = Path(path)
    partial = target.with_name(f"{target.name}.{os.environ['PYTEST_XDIST_WORKER']}")
    partial.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    partial.replace(target)


def make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduling with the groups above as scopes (a test not in the map: its own scope)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once, after every worker has collected
                self.groups = json.loads(Path(os.environ[ENV]).read_text())
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)
