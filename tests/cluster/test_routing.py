"""Routing rules (pure: no Ray): new takes by free places, retakes to their parent's cache or rebuilt;
and single-process mode never imports Ray."""

from __future__ import annotations

import subprocess
import sys

from moss_rt.cluster.routing import Candidate, Route, plan_routes


def cands(*specs: tuple[str, bool, int], incarnation: str = "i1") -> list[Candidate]:
    return [Candidate(name, incarnation, routable, free) for name, routable, free in specs]


def test_new_take_goes_to_the_most_free_routable_replica() -> None:
    routes = plan_routes(cands(("r0", True, 2), ("r1", True, 5), ("r2", False, 9)))
    assert routes == [Route("r1", False), Route("r0", False)]  # r2 is not ready: never tried


def test_ties_rotate_so_equal_replicas_share_new_takes() -> None:
    c = cands(("r0", True, 4), ("r1", True, 4), ("r2", True, 4))
    assert [plan_routes(c, turn=t)[0].name for t in range(3)] == ["r0", "r1", "r2"]


def test_no_routable_replica_means_no_route() -> None:
    assert plan_routes(cands(("r0", False, 4), ("r1", False, 4))) == []


def test_retake_sticks_to_the_replica_holding_its_parent() -> None:
    c = cands(("r0", True, 8), ("r1", True, 1))
    routes = plan_routes(c, retake=True, holder=("r1", "i1"))
    assert routes == [Route("r1", False), Route("r0", True)]


def test_retake_is_rebuilt_elsewhere_when_the_holder_is_gone_restarted_or_unknown() -> None:
    down = cands(("r0", True, 3), ("r1", False, 8))
    assert plan_routes(down, retake=True, holder=("r1", "i1")) == [Route("r0", True)]
    restarted = [Candidate("r0", "i1", True, 3), Candidate("r1", "i2", True, 8)]
    # r1 answers again, but as a new process: the parent's cache died with the old one.
    assert plan_routes(restarted, retake=True, holder=("r1", "i1")) == [Route("r1", True), Route("r0", True)]
    assert plan_routes(cands(("r0", True, 3)), retake=True, holder=None) == [Route("r0", True)]


def test_a_full_holder_is_tried_last() -> None:
    c = cands(("r0", True, 0), ("r1", True, 2))
    assert plan_routes(c, retake=True, holder=("r0", "i1")) == [Route("r1", True), Route("r0", False)]


def test_single_process_mode_never_imports_ray() -> None:
    """`make run` needs no Ray: building the app and its engine without --cluster imports none of it."""
    code = (
        "import sys\n"
        "from moss_rt.cli import build_engine\n"
        "from moss_rt.config import Settings\n"
        "from moss_rt.web import create_app\n"
        "create_app(Settings(engine='scripted'), build_engine(Settings(engine='scripted')))\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'moss_rt.cluster'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
