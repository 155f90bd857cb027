"""No remedy that the loader's own arguments make invalid: dlwatch's rules against the real torch.

Every ``DataLoader(...)`` snippet of every shipped playbook is applied to real loaders (without workers,
with fork workers) and iterated for a batch: ``remedy.invalid_reason`` must say "invalid" exactly when
torch refuses it.  Then ``remedy.fit`` must leave no refused snippet in any playbook's whole remediation
for a loader without workers, and keep every snippet for a loader with workers.
"""

from __future__ import annotations


import pytest
from torch.utils.data import DataLoader

from dlwatch.detect import remedy
from dlwatch.wire.playbooks import load_playbooks

LOADERS = {
    "no workers": {"num_workers": 0},
    "fork workers": {"num_workers": 2, "multiprocessing_context": "fork"},
}


def _texts():
    for pb in load_playbooks(()):
        yield pb.id, "text", pb.remediation or ""
        for name, text in pb.variants.items():
            yield pb.id, name, text
        for h in pb.hints:
            yield pb.id, f"hint {h.name}", h.text or ""


def _concrete(kwargs, loader):
    """The snippet's keywords with values torch can take: a placeholder (N, ...) becomes a real value."""
    fill = {
        "num_workers": 2,
        "timeout": 120,
        "prefetch_factor": 2,
        "persistent_workers": True,
        "batch_size": 2,
        "multiprocessing_context": "spawn",
        "pin_memory": False,
    }
    out = {}
    for k, v in kwargs.items():
        if k in ("worker_init_fn", "generator"):
            continue  # a function or a generator of the user's: no bearing on what torch refuses
        out[k] = fill.get(k, v) if v == remedy._PLACEHOLDER else v
    if out.get("multiprocessing_context") == "spawn":
        out["multiprocessing_context"] = "fork"  # the same rule, without a spawned interpreter per case
    return {**loader, **out}


def _torch_refuses(cfg):
    try:
        loader = DataLoader(list(range(8)), **cfg)
        it = iter(loader)
        next(it)
        del it
    except (ValueError, AssertionError, RuntimeError) as exc:
        return str(exc)
    return None


CASES = [
    (pid, piece, kw, name) for pid, piece, text in _texts() for _, _, kw in remedy.snippets(text) for name in LOADERS
]


def test_the_playbooks_hold_snippets_to_check():
    assert len({(pid, piece) for pid, piece, _, _ in CASES}) >= 10


@pytest.mark.parametrize("pid,piece,kwargs,loader", CASES, ids=lambda x: x if isinstance(x, str) else None)
def test_dlwatch_calls_a_snippet_invalid_exactly_when_torch_refuses_it(pid, piece, kwargs, loader):
    cfg = _concrete(kwargs, LOADERS[loader])
    refused = _torch_refuses(cfg)
    said = remedy.invalid_reason(LOADERS[loader], {k: cfg[k] for k in kwargs if k in cfg})
    assert (said is not None) == (refused is not None), (pid, piece, cfg, said, refused)


def test_fit_leaves_no_refused_snippet_for_a_loader_without_workers():
    for pb in load_playbooks(()):
        whole = "\n\n".join([*(h.text or "" for h in pb.hints), *pb.variants.values(), pb.remediation or ""])
        for name, loader in LOADERS.items():
            fitted = remedy.fit(whole, loader)
            for _, _, kw in remedy.snippets(fitted):
                assert remedy.invalid_reason(loader, kw) is None, (pb.id, name, kw)
            if name == "fork workers":
                assert fitted == whole  # nothing is taken from a loader the snippets fit
    text = "- Bound the wait:\n  `DataLoader(..., timeout=120)` raises an error.\n- Fix the producer."
    assert remedy.fit(text, {"num_workers": 0}) == "- Fix the producer."
    assert remedy.fit(text, {"num_workers": 4}) == text
