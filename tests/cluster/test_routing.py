"""Routing rules (pure: no Ray): new takes by free places or by the prompt blocks replicas hold (within a load
margin), retakes to their parent's cache or rebuilt; and single-process mode never imports Ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_a_new_take_goes_to_the_replica_holding_most_of_its_prompt_unless_it_is_too_busy() -> None:
    c = [Candidate("r0", "i", True, 4, load=4), Candidate("r1", "i", True, 8, load=0), Candidate("r2", "i", True, 6, 2)]
    held = {"r0": 64, "r2": 32}
    assert plan_routes(c, cached=held, margin=4) == [Route("r0", False, 64), Route("r1", False), Route("r2", False, 32)]
    # r0 is more than 3 takes above the least loaded: the longest run held within the margin wins.
    assert plan_routes(c, cached=held, margin=3)[0] == Route("r2", False, 32)
    # Nobody holding the prompt within the margin, or routing by load alone: most free first.
    assert plan_routes(c, cached={"r0": 64}, margin=3)[0].name == "r1"
    assert plan_routes(c, cached=held, margin=-1)[0].name == "r1"
    assert plan_routes(c, cached={}, margin=8)[0].name == "r1"


def test_equal_runs_go_to_the_less_loaded_and_a_holder_without_a_free_slot_is_passed_over() -> None:
    c = [Candidate("r0", "i", True, 2, load=6), Candidate("r1", "i", True, 5, load=3)]
    assert plan_routes(c, cached={"r0": 48, "r1": 48}, margin=8)[0].name == "r1"
    full = [Candidate("r0", "i", True, 0, load=8), Candidate("r1", "i", True, 5, load=3)]
    assert plan_routes(full, cached={"r0": 48}, margin=8)[0].name == "r1"
    # Queue places left but no slot: the take would wait behind others there, longer than its prefill takes.
    queued = [Candidate("r0", "i", True, 4, load=4, idle=0), Candidate("r1", "i", True, 8, load=0, idle=4)]
    assert plan_routes(queued, cached={"r0": 48}, margin=8)[0].name == "r1"


def test_a_rebuilt_retake_also_prefers_the_replica_holding_its_prompt() -> None:
    c = [Candidate("r0", "i", True, 3, load=5), Candidate("r1", "i", True, 8, load=0), Candidate("r2", "i", True, 6, 2)]
    routes = plan_routes(c, retake=True, holder=("r0", "old"), cached={"r2": 16}, margin=4)
    assert routes == [Route("r2", True, 16), Route("r1", True), Route("r0", True)]
    # The sticky route is unchanged: the parent's own replica first, whatever others hold.
    assert plan_routes(c, retake=True, holder=("r0", "i"), cached={"r2": 16}, margin=4)[0] == Route("r0", False)


def test_single_process_mode_never_imports_ray(tmp_path: Path) -> None:
    """`make run` needs no Ray: building the app and its engine without --cluster imports none of it."""
    # The app writes its data dir (owner secret, sessions): the test's own, not ./data of the checkout.
    settings = f"Settings(engine='scripted', data_dir=Path({str(tmp_path / 'data')!r}))"
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from moss_rt.serving import build_engine\n"
        "from moss_rt.config import Settings\n"
        "from moss_rt.web.app import create_app\n"
        f"create_app({settings}, build_engine({settings}))\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'moss_rt.cluster'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
