"""GEMM kernel plans: every kernel equals nn.Linear; plans are measured once and persisted."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from services.worker.engine.cpu import coded, cpu_ops, gemm, gemm_store
from services.worker.engine.cpu.gemm import KERNELS, PLAN_FILE, Plan, plain_linears, tune_linears


@pytest.fixture(autouse=True)
def fresh_memory(monkeypatch):
    monkeypatch.setattr(gemm_store, "_memory", {})


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16, bias=False))


def tune(model: nn.Module, rows: int, cache_dir) -> None:
    tune_linears(plain_linears(model), None, rows, rows, cache_dir)


def force(model: nn.Module, kernel: str) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            gemm.apply_plan(m, Plan((kernel,) * 8))


# the libraries' kernels; the engine's own (the GEMVs, panel, panel8, q4, q8), per ISA: test_engine_cpu_kernels.py
# and test_engine_coded_gemm.py
@pytest.mark.parametrize("kernel", sorted(n for n in KERNELS if not n.startswith(("gemv", "panel", "q4", "q8"))))
@pytest.mark.parametrize("rows", [1, 3, 32, 77])
def test_every_kernel_gives_the_same_output_as_nn_linear_with_and_without_bias(kernel, rows):
    model = tiny_model()  # first layer has a bias, the second none
    x = torch.randn(1, rows, 32)
    with torch.inference_mode():
        expected = model(x)
        tune(model, 128, None)
        force(model, kernel)
        got = model(x)
    assert got.shape == expected.shape == (1, rows, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def measure_where_fastest(monkeypatch, fastest: str) -> tuple[dict, list[tuple[str, int]]]:
    """Plans for 8 buckets (1 ... 128 rows) where `fastest` times fastest at every size; -> (plans, every
    (kernel, rows) timed)."""
    model = tiny_model()
    targets = [(m, f"k{i}", 8) for i, m in enumerate(plain_linears(model))]
    timed = []

    def fake_pass(name, live, names, xs, packs):
        timed.append((name, next(iter(xs.values())).shape[0]))
        return {k: 0.0 if name == fastest else 1.0 for _, k in live}

    monkeypatch.setattr(gemm, "_usable", lambda name, x, w, packed: True)
    monkeypatch.setattr(gemm, "_timed_pass", fake_pass)
    return gemm.measure(targets, gemm.offered(True)), timed


def test_gemv_is_chosen_only_for_buckets_of_rows_it_takes(monkeypatch):
    """Even where it would time fastest at every size, gemv is neither measured nor chosen above its row limit."""
    plans, timed = measure_where_fastest(monkeypatch, "gemv")
    limit = gemm.GEMV_MAX_ROWS.bit_length()  # buckets 1, 2, 4, ... GEMV_MAX_ROWS
    assert all(p == ("gemv",) * limit + ("linear",) * (8 - limit) for p in plans.values())
    assert max(rows for name, rows in timed if name == "gemv") == gemm.GEMV_MAX_ROWS
    assert "gemv" not in gemm.offered(False) and "gemv256" not in gemm.offered(False)


def test_the_gemv_without_l2_prefetches_is_measured_up_to_its_own_row_limit(monkeypatch):
    plans, timed = measure_where_fastest(monkeypatch, "gemv_near")
    near = gemm.NEAR_MAX_ROWS.bit_length()  # buckets 1, 2, 4, 8
    assert all(p[:near] == ("gemv_near",) * near and "gemv_near" not in p[near:] for p in plans.values())
    assert max(rows for name, rows in timed if name == "gemv_near") == gemm.NEAR_MAX_ROWS
    assert "gemv_near" not in gemm.offered(False) and "gemv256_near" not in gemm.offered(False)


@pytest.mark.parametrize(
    ("times", "chosen"),
    [
        ({"gemv": 0.95, "packed": 0.95}, "gemv"),  # the own kernel 5 % faster: chosen
        ({"packed": 0.95}, "linear"),  # a library's packed kernel 5 % faster: under its 10 % bar
        ({"packed": 0.85, "gemv": 0.95}, "packed"),  # both over their bars: the faster
        ({"gemv": 0.98}, "linear"),  # within the noise
    ],
)
def test_the_own_gemv_needs_a_smaller_lead_over_linear_than_a_packed_kernel(monkeypatch, times, chosen):
    model = tiny_model()
    targets = [(m, f"k{i}", 1) for i, m in enumerate(plain_linears(model))]  # one bucket: M = 1

    def fake_pass(name, live, names, xs, packs):
        return {k: times.get(name, 1.0) for _, k in live}

    monkeypatch.setattr(gemm, "_usable", lambda name, x, w, packed: True)
    monkeypatch.setattr(gemm, "_timed_pass", fake_pass)
    plans = gemm.measure(targets, ("linear", "packed", "gemv"))
    assert all(p == (chosen,) for p in plans.values())


def test_plan_bucket_is_the_next_power_of_two_of_the_row_count():
    plan = Plan(("linear", "flipped", "linear", "onednn"))  # buckets M<=1, M<=2, M<=4, M<=8 (and beyond)
    assert [plan.kernel_for(m) for m in (1, 2, 3, 4, 5, 8, 9, 1000)] == [
        "linear",
        "flipped",
        "linear",
        "linear",
        "onednn",
        "onednn",
        "onednn",
        "onednn",
    ]


def test_a_kernel_that_fails_here_is_never_planned(monkeypatch):
    def broken(x, w, b, packed):
        raise RuntimeError("not built into this torch")

    monkeypatch.setitem(KERNELS, "onednn", broken)
    model = tiny_model()
    tune(model, 64, None)
    assert all("onednn" not in m.conveyor_gemm_plan.kernels for m in model.modules() if isinstance(m, nn.Linear))


def test_measured_plan_is_saved_and_a_restart_reuses_it_without_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "others_busy", lambda before, after: 0.0)  # measured on a quiet machine: final
    first = tiny_model()
    tune(first, 64, tmp_path)
    assert (tmp_path / PLAN_FILE).exists()
    plans = [m.conveyor_gemm_plan for m in first.modules() if isinstance(m, nn.Linear)]
    monkeypatch.setattr(gemm_store, "_memory", {})  # a new process
    monkeypatch.setattr(gemm, "measure", lambda *a: pytest.fail("measured again despite the saved plan"))
    second = tiny_model()
    tune(second, 64, tmp_path)
    assert [m.conveyor_gemm_plan for m in second.modules() if isinstance(m, nn.Linear)] == plans


def test_unreadable_plan_file_is_measured_again_and_rewritten(tmp_path):
    (tmp_path / PLAN_FILE).write_text("{not json")
    model = tiny_model()
    tune(model, 16, tmp_path)
    assert all(hasattr(m, "conveyor_gemm_plan") for m in model.modules() if isinstance(m, nn.Linear))
    assert (tmp_path / PLAN_FILE).read_text().startswith("{\n")


def test_tuning_keeps_the_tied_output_head_sharing_the_embedding(engine_model, monkeypatch):
    """Even with a plan that holds a packed copy of the head: the copy is beside the weight, never instead of it.
    (The plans are given, not measured: measuring the model's seven buckets took 37 s of the suite.)"""
    monkeypatch.setattr(gemm_store, "_memory", {})  # this process's other engine tests never see these plans
    monkeypatch.setattr(gemm, "measure", lambda targets, kernels: {k: ("packed",) * b for _, k, b in targets})
    head = engine_model.get_output_embeddings()
    tune_linears(plain_linears(engine_model), head, 64, 64, None)
    assert head.weight.data_ptr() == engine_model.get_input_embeddings().weight.data_ptr()
    assert type(head) is nn.Linear and head.conveyor_gemm_plan.kernel_for(1) == "packed"
    assert head.conveyor_copies["packed"] is not None


def test_workers_starting_together_measure_each_shape_once(tmp_path):
    """Two processes tune the same shapes against one cache dir at the same time: the lock makes one wait
    and reuse what the other measured (concurrent timings would skew each other)."""
    code = (
        "import logging, sys, time\n"
        "from torch import nn\n"
        "from services.worker.engine.cpu import gemm\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "gemm.others_busy = lambda before, after: 0.0  # each other's start is not load to re-measure for\n"
        "real = gemm.measure\n"
        "gemm.measure = lambda t, k: time.sleep(1.0) or real(t, k)  # a window wide enough to overlap\n"
        "gemm.tune_linears([nn.Linear(32, 48), nn.Linear(48, 16)], None, 16, 16, sys.argv[1])\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    logs = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    counts = [int(m) for log in logs for m in re.findall(r"measured for (\d+) weight shapes", log)]
    assert sum(counts) == 2, logs  # two shapes, each measured by exactly one process


def measured_counts(monkeypatch) -> list[int]:
    """Counts gemm.measure's calls (it still measures)."""
    calls, real = [], gemm.measure
    monkeypatch.setattr(gemm, "measure", lambda targets, kernels: calls.append(len(targets)) or real(targets, kernels))
    return calls


def saved_entries(cache_dir) -> list[dict]:
    return list(json.loads((cache_dir / PLAN_FILE).read_text()).values())


def test_a_plan_measured_under_load_is_measured_again_at_the_next_quiet_start(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "others_busy", lambda before, after: 0.9)  # others kept 90 % of the cores busy
    tune(tiny_model(), 16, tmp_path)
    assert all(e["others_busy"] == 0.9 and e["tries"] == 1 for e in saved_entries(tmp_path))
    monkeypatch.setattr(gemm_store, "_memory", {})  # a new process, on a quiet machine
    monkeypatch.setattr(gemm, "others_busy_now", lambda: 0.0)
    monkeypatch.setattr(gemm, "others_busy", lambda before, after: 0.02)
    calls = measured_counts(monkeypatch)
    tune(tiny_model(), 16, tmp_path)
    assert calls == [2]  # both layers' shapes
    assert all(e["others_busy"] == 0.02 and e["tries"] == 2 for e in saved_entries(tmp_path))
    monkeypatch.setattr(gemm_store, "_memory", {})  # measured quiet: the next start only reads it
    tune(tiny_model(), 16, tmp_path)
    assert calls == [2]


def test_a_plan_measured_under_load_is_kept_while_starts_find_the_machine_loaded(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "others_busy", lambda before, after: 0.9)
    tune(tiny_model(), 16, tmp_path)
    monkeypatch.setattr(gemm_store, "_memory", {})
    monkeypatch.setattr(gemm, "others_busy_now", lambda: 0.7)
    calls = measured_counts(monkeypatch)
    tune(tiny_model(), 16, tmp_path)
    assert calls == []


def test_a_plan_measured_under_load_every_time_is_kept_after_the_last_try(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "others_busy", lambda before, after: 0.9)  # loaded whenever it measures
    monkeypatch.setattr(gemm, "others_busy_now", lambda: 0.0)  # yet quiet at every start
    calls = measured_counts(monkeypatch)
    for _ in range(gemm.MAX_TRIES + 2):
        monkeypatch.setattr(gemm_store, "_memory", {})
        tune(tiny_model(), 16, tmp_path)
    assert calls == [2] * gemm.MAX_TRIES
    assert all(e["tries"] == gemm.MAX_TRIES for e in saved_entries(tmp_path))


def test_a_layer_holds_the_weight_copies_of_the_kernels_its_plan_uses_and_no_others(monkeypatch):
    made = []
    monkeypatch.setitem(gemm.COPIES, "panel", lambda w: made.append("panel") or w.t().contiguous())
    monkeypatch.setitem(gemm.COPIES, "packed", lambda w: made.append("packed") or w.clone())
    layer = nn.Linear(8, 4)
    gemm.apply_plan(layer, Plan(("gemv", "linear")))
    assert layer.conveyor_copies == {} and made == []
    gemm.apply_plan(layer, Plan(("gemv", "panel", "panel")))
    assert set(layer.conveyor_copies) == {"panel"} and made == ["panel"]


def test_panel_and_panel8_in_one_plan_share_one_panel_copy(monkeypatch):
    made = []
    monkeypatch.setitem(gemm.COPIES, "panel", lambda w: made.append("panel") or w.t().contiguous())
    layer = nn.Linear(8, 4)
    gemm.apply_plan(layer, Plan(("gemv", "panel", "panel8")))
    assert set(layer.conveyor_copies) == {"panel"} and made == ["panel"]


def plans_from_times(monkeypatch, times: dict[str, list[float]], kernels: tuple[str, ...]) -> dict:
    """gemm.measure over the tiny model's layers (4 buckets: 1, 2, 4, 8 rows) with each kernel's pass taking
    times[kernel][bucket] (linear, and any kernel not named: 1.0), every kernel usable."""
    targets = [(m, f"k{i}", 4) for i, m in enumerate(plain_linears(tiny_model()))]

    def fake_pass(name, live, names, xs, copies):
        bucket = next(iter(xs.values())).shape[0].bit_length() - 1
        return {k: times.get(name, [1.0] * 4)[bucket] for _, k in live}

    monkeypatch.setattr(gemm, "_usable", lambda name, x, w, copy: True)
    monkeypatch.setattr(gemm, "_timed_pass", fake_pass)
    return gemm.measure(targets, kernels)


def test_a_plan_may_mix_panel_and_panel8_and_never_adds_a_packed_copy(monkeypatch):
    """panel8 reads panel's copy: a plan with panel at few rows and panel8 at many holds that one copy, so it beats
    the plans with packed, which would hold a second."""
    times = {"panel": [0.6, 0.6, 0.8, 0.8], "panel8": [0.7, 0.7, 0.6, 0.5], "packed": [0.9, 0.9, 0.55, 0.45]}
    plans = plans_from_times(monkeypatch, times, ("linear", "packed", "panel", "panel8"))
    assert all(p == ("panel", "panel", "panel8", "panel8") for p in plans.values())


@pytest.mark.parametrize(("isa", "offered"), [("avx512", True), ("avx2", False)])
def test_panel8_is_offered_only_where_the_kernels_have_16_lanes(monkeypatch, isa, offered):
    """On avx2 its tiles are panel's (8 lanes hold no tile of 8 rows): measuring it would only add start-up time."""
    monkeypatch.setattr(cpu_ops, "active_isa", lambda: isa)
    assert ("panel8" in gemm.offered(gemv=True)) is offered
    assert "panel8" not in gemm.offered(gemv=False)


def test_a_kernel_whose_weight_copy_cannot_be_made_is_never_planned(monkeypatch):
    def no_copy(w):
        raise RuntimeError("the engine's CPU kernels are not loaded")

    monkeypatch.setitem(gemm.COPIES, "panel", no_copy)
    monkeypatch.setattr(gemm, "_timed_pass", lambda name, live, names, xs, copies: {k: 0.0 for _, k in live})
    model = tiny_model()
    targets = [(m, f"k{i}", 3) for i, m in enumerate(plain_linears(model))]
    plans = gemm.measure(targets, ("linear", "panel", "panel8"))
    assert all(p == ("linear",) * 3 for p in plans.values())


def test_a_plan_holds_one_weight_copy_the_one_that_saves_most_time_summed_over_buckets(monkeypatch):
    """panel fastest at 1-4 rows, packed 2 % faster than panel at 8: one copy (panel), not both; where packed is
    far ahead at the top bucket only, panel's lead at the others still wins."""
    times = {  # per bucket (1, 2, 4, 8 rows): kernel -> time, linear 1.0
        "panel": [0.6, 0.6, 0.6, 0.5],
        "packed": [0.9, 0.9, 0.8, 0.49],
        "gemv": [0.7, 0.95, 1.0, 1.0],
    }
    plans = plans_from_times(monkeypatch, times, ("linear", "packed", "gemv", "panel"))
    assert all(p == ("panel",) * 4 for p in plans.values())


def test_a_plan_may_hold_the_small_q4_copy_beside_a_float32_one(monkeypatch):
    """q4 fastest at 1-4 rows, panel at 8: both copies (q4 is a sixth of the weight), each where it is fastest."""
    times = {"q4": [0.3, 0.3, 0.5, 0.9], "panel": [0.6, 0.6, 0.6, 0.5], "packed": [0.9, 0.9, 0.8, 0.55]}
    plans = plans_from_times(monkeypatch, times, ("linear", "packed", "panel", "q4"))
    assert all(p == ("q4", "q4", "q4", "panel") for p in plans.values())


def test_the_q4_kernel_is_planned_only_for_weights_that_are_4_bit_blocks(monkeypatch):
    """Two layers of one shape, one of them 4-bit blocks: the plans are keyed apart, and only that one gets q4
    (whether a weight is coded blocks is a property of its values, not of its shape)."""
    monkeypatch.setattr(gemm, "offered", lambda gemv: ("linear", "q4"))
    monkeypatch.setitem(gemm.COPIES, "q4", lambda w: _q4_copy(w))
    monkeypatch.setitem(gemm.KERNELS, "q4", lambda x, w, b, copy: torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(
        gemm, "_timed_pass", lambda name, live, names, xs, copies: {k: 0.5 if name == "q4" else 1.0 for _, k in live}
    )
    blocks, plain = nn.Linear(64, 16, bias=False), nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        blocks.weight.copy_(torch.arange(16 * 64).remainder(16).float().view(16, 64) * 0.5 - 1.0)
    tune_linears([blocks, plain], None, 4, 4, None, gemv=True)
    assert set(blocks.conveyor_gemm_plan.kernels) == {"q4"} and set(blocks.conveyor_copies) == {"q4"}
    assert set(plain.conveyor_gemm_plan.kernels) == {"linear"} and "conveyor_coded" not in vars(plain)


def _q4_copy(w: torch.Tensor) -> torch.Tensor:
    if coded.recover_q4(w) is None:
        raise RuntimeError("not 4-bit blocks")
    return w.clone()


def test_an_engine_that_does_not_measure_reads_coded_weights_as_codes_up_to_32_rows(make_engine):
    """gemm_tuning off (make_engine's default): the bundled model's layers run on their 4-bit codes and its tied head on
    its 8-bit ones at 1-32 rows, the decode steps, and F.linear beyond, with no measuring."""
    runner = make_engine().runner
    plans = [Plan(lin.conveyor_gemm_plan.kernels) for lin in runner.fused.linears()]
    assert len(plans) == 4 * len(runner.fused.layers) + 1
    for plan, codes in zip(plans, ["q4"] * (len(plans) - 1) + ["q8"]):
        assert [plan.kernel_for(m) for m in (1, 2, 17, 32, 33, 512)] == [codes] * 4 + ["linear"] * 2


def test_a_weight_that_is_not_coded_keeps_f_linear_when_nothing_is_measured(make_engine):
    make_engine()  # the CPU kernels loaded, as at an engine's start
    plain = tiny_model()[0]
    assert gemm.unmeasured_plans([plain]) == 0
    assert not hasattr(plain, "conveyor_gemm_plan") and "conveyor_coded" not in vars(plain)


def test_a_kernel_whose_copy_the_plan_holds_is_taken_where_it_leads_linear_by_less_than_its_margin(monkeypatch):
    """The margin prices holding a copy: once the plan holds one (here for one row, where the panel GEMM leads by
    half), its kernel is taken at 512 rows too, 5 % ahead of linear there. Why: a bar measured fast by luck (one of
    linear's passes in a quiet second) sent every 512-row prefill of three weights to F.linear, ~35 % slower in the
    layer stack than the panel GEMM whose copy the plan held anyway (docs/benchmarks.md, 2026-12-07)."""
    model = tiny_model()
    targets = [(m, f"k{i}", 10) for i, m in enumerate(plain_linears(model))]  # buckets 1 ... 512 rows

    def fake_pass(name, live, names, xs, packs):
        rows = next(iter(xs.values())).shape[0]
        lead = {"panel": 0.5 if rows == 1 else 0.95}.get(name, 1.0)
        return {k: lead for _, k in live}

    monkeypatch.setattr(gemm, "_usable", lambda name, x, w, packed: True)
    monkeypatch.setattr(gemm, "_timed_pass", fake_pass)
    plans = gemm.measure(targets, ("linear", "panel"))
    assert all(p == ("panel",) * 10 for p in plans.values())


def test_a_copy_that_leads_by_less_than_its_margin_everywhere_is_not_held(monkeypatch):
    model = tiny_model()
    targets = [(m, f"k{i}", 3) for i, m in enumerate(plain_linears(model))]

    def fake_pass(name, live, names, xs, packs):
        return {k: 0.95 if name == "panel" else 1.0 for _, k in live}

    monkeypatch.setattr(gemm, "_usable", lambda name, x, w, packed: True)
    monkeypatch.setattr(gemm, "_timed_pass", fake_pass)
    plans = gemm.measure(targets, ("linear", "panel"))
    assert all(p == ("linear",) * 3 for p in plans.values())
