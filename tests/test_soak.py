"""The soak's short variant (benchmarks/soak.py: a real server, tiers on, small pool,
disconnects and aborts, then checked idle), and its checks shown to go red."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.soak import Report, check_idle, compare, parse_args, soak, tally
from benchmarks.soak_workload import COMPLETIONS, Job, Mix, Outcome, make_jobs

# The online audit replays half the hits (kernel/audit.py): every replay must match.
SHORT = ["--requests", "60", "--concurrency", "16", "--warmup", "16", "--quiet", "--audit-rate", "0.5"]


async def test_short_soak_has_no_violation(tiny_chat_folder: str, tmp_path: Path) -> None:
    args = parse_args(SHORT)
    report = await soak(args, tiny_chat_folder, tmp_path)
    assert report.violations == [], report
    assert report.requests == 60 and report.server_errors == 0 and report.leaked_pages == 0
    assert report.disconnects > 0 and report.completed > 30 and report.greedy_compared > 10, report
    assert report.tiers["host_hit_tokens"] > 0 and report.tiers["storage_written_pages"] > 0, report
    assert report.exit_code == 0
    assert report.audit is not None and sum(report.audit["checked"].values()) > 0, report.audit


def test_workload_mixes_every_kind_of_request() -> None:
    jobs = make_jobs(400, 0, Mix())
    streams = [j for j in jobs if j.stream]
    assert 0.1 < sum(j.disconnect_after is not None for j in streams) / len(streams) < 0.3
    assert any(j.abort_after_s is not None for j in jobs) and any(j.route != COMPLETIONS for j in jobs)
    assert any(j.greedy for j in jobs) and any(not j.greedy for j in jobs)
    heads = {tuple(j.prompt[:8]) for j in jobs}
    assert len(heads) < 200  # shared prefixes
    assert len({tuple(j.prompt) for j in jobs}) == 400  # ... and every prompt distinct


IDLE: dict[str, Any] = {
    "idle": True, "halt_reason": None, "requests": {"waiting": 0, "running": 0},
    "pages": {"usable": 10, "free": 6, "cached": 4, "held": 0}, "rows": {"usable": 8, "free": 8},
    "host": {"host_hit_tokens": 8, "host_pages": {"usable": 8, "free": 8, "cached": 0, "copying": 0}},
    "storage": {"written_pages": 3, "read_pages": 0}, "cache": {"prefix_hit_tokens": 16},
}


def test_idle_check_goes_red_on_each_leak() -> None:
    clean = Report()
    check_idle(clean, IDLE, {"ok": True})
    assert clean.violations == []
    planted = [
        {**IDLE, "pages": {"usable": 10, "free": 5, "cached": 4, "held": 1}},
        {**IDLE, "rows": {"usable": 8, "free": 7}},
        {**IDLE, "host": {"host_hit_tokens": 0, "host_pages": {"usable": 8, "free": 7, "cached": 0, "copying": 1}}},
        {**IDLE, "idle": False},
        {**IDLE, "storage": {"written_pages": 0, "read_pages": 0}},
    ]
    for stats in planted:
        report = Report()
        check_idle(report, stats, {"ok": True})
        assert len(report.violations) == 1, (stats, report.violations)
    broken = Report()
    check_idle(broken, IDLE, {"ok": False, "message": "node 3 lock_ref -1"})
    assert broken.violations and "integrity" in broken.violations[0]
    audited = {"checked": {"device": 3, "host": 1, "storage": 0}, "mismatched": {"device": 0, "host": 0, "storage": 0},
               "errors": 0}
    clean = Report()
    check_idle(clean, {**IDLE, "audit": audited}, {"ok": True})
    assert clean.violations == []
    for bad in ({**audited, "mismatched": {"device": 0, "host": 1, "storage": 0}}, {**audited, "errors": 1},
                {**audited, "checked": {"device": 0, "host": 0, "storage": 0}}):
        report = Report()
        check_idle(report, {**IDLE, "audit": bad}, {"ok": True})
        assert len(report.violations) == 1 and "audit" in report.violations[0], report.violations


def outcome(job: Job, **fields: Any) -> Outcome:
    base: dict[str, Any] = {"status": 200, "text": "abc", "completion_tokens": job.max_tokens, "finish_reason": "length"}
    return Outcome(job, **{**base, **fields})


def test_tally_and_compare_go_red() -> None:
    job = Job(0, COMPLETIONS, [5, 6], 4, greedy=True, stream=False)
    cut = Job(1, COMPLETIONS, [5, 7], 4, greedy=True, stream=True, disconnect_after=1)
    good = [outcome(job), outcome(cut, cut=True, completion_tokens=1, finish_reason=None)]
    report = Report()
    tally(report, good)
    compare(report, good, {0: ("abc", None)})
    assert report.violations == [] and report.disconnects == 1 and report.greedy_compared == 1

    for bad in (outcome(job, status=500, error="boom"), outcome(job, completion_tokens=3),
                outcome(job, finish_reason="abort")):
        report = Report()
        tally(report, [bad])
        assert report.violations, bad
    differs = Report()
    compare(differs, [outcome(job, text="abd")], {0: ("abc", None)})
    assert differs.violations and "differ" in differs.violations[0]


# Planted in the soaked server's process at start (its sitecustomize, through PYTHONPATH):
# tests/test_audit.py's stale page, a hit mapping its first cached page where its second belongs.
STALE_PAGE_PLANT = '''
from kernel.scheduling.prefix_reuse import PrefixReuse

_real_match = PrefixReuse.match


def _stale_second_page(self, req):
    _real_match(self, req)
    if req.shared_pages >= 2:
        self.req_table.write_pages(req.row, 1, [req.pages[0]], self.page_size)


PrefixReuse.match = _stale_second_page
'''


async def test_red_a_stale_page_on_a_soak_is_caught_by_the_audit(tiny_chat_folder: str, tmp_path: Path) -> None:
    """The stale-page bug planted in a real server under the soak (tiers on, disconnects,
    the integrity check off, no reference run): the audit's sampled replays catch it, the
    soak reports it, and the server keeps serving every request to the end."""
    import os

    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(STALE_PAGE_PLANT)
    path = os.pathsep.join(p for p in (str(plant), os.environ.get("PYTHONPATH", "")) if p)
    args = parse_args([*SHORT, "--no-check-invariants", "--no-reference"])
    report = await soak(args, tiny_chat_folder, tmp_path, server_env={"PYTHONPATH": path})
    audit = report.audit
    assert audit is not None
    checked, mismatched = sum(audit["checked"].values()), sum(audit["mismatched"].values())
    assert mismatched >= 1 and audit["last_mismatch"] is not None, audit
    assert checked <= 60, audit  # within the run's sampled hits (half the hits of 60 requests)
    assert any("audit" in v for v in report.violations), report.violations
    assert report.server_errors == 0 and report.requests == 60 and report.completed > 30, report
    assert report.exit_code == 0
