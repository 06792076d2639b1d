"""What is built or measured once per CPU is keyed by its model and ISA flags, and the ISA variant picked follows
the flags (cpu_info.py, cpu_ops.py, gemm.py's plan key). No compiler runs here: names and choices only."""

from __future__ import annotations

import functools
import os

import pytest

from services.worker.engine.cpu import cpu_ops, gemm, gemm_store
from services.worker.engine.cpu.cpu_info import CpuInfo, CpuSample, others_busy, parse_cpuinfo

ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 fma f16c avx avx2 bmi1 bmi2 hypervisor"
ZEN4 = ZEN3 + " avx512f avx512bw avx512vl avx512dq avx512cd"


def cpuinfo(name: str, flags: str) -> str:
    return f"processor\t: 0\nmodel name\t: {name}\nflags\t\t: {flags}\n\nprocessor\t: 1\nmodel name\t: {name}\n"


def test_cpuinfo_gives_the_first_processors_model_name_and_flags():
    cpu = parse_cpuinfo(cpuinfo("AMD EPYC 7B13", ZEN3))
    assert cpu.name == "AMD EPYC 7B13"
    assert {"avx2", "fma", "hypervisor"} <= cpu.flags


def test_identity_differs_between_cpus_of_one_name_with_other_isa_flags():
    a = parse_cpuinfo(cpuinfo("AMD EPYC", ZEN3))
    b = parse_cpuinfo(cpuinfo("AMD EPYC", ZEN4))
    assert a.identity() != b.identity()


def test_identity_ignores_flags_that_change_no_code():
    a = parse_cpuinfo(cpuinfo("AMD EPYC", ZEN3))
    b = parse_cpuinfo(cpuinfo("AMD EPYC", ZEN3.replace(" hypervisor", "") + " tsc_known_freq"))
    assert a.identity() == b.identity()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(ZEN4, ("avx512", "avx2", "portable")), (ZEN3, ("avx2", "portable")), ("fpu sse sse2", ("portable",))],
)
def test_available_variants_follow_the_cpu_flags(flags, expected):
    assert cpu_ops.available(CpuInfo("x", frozenset(flags.split()))) == expected


def test_auto_picks_the_best_variant_and_a_forced_one_is_kept_where_the_cpu_runs_it():
    zen4 = CpuInfo("x", frozenset(ZEN4.split()))
    assert cpu_ops.choose("auto", zen4) == "avx512"
    assert cpu_ops.choose("avx2", zen4) == "avx2"
    assert cpu_ops.choose("portable", zen4) == "portable"


def test_a_forced_variant_the_cpu_lacks_falls_back_to_the_best_it_has(caplog):
    zen3 = CpuInfo("x", frozenset(ZEN3.split()))
    assert cpu_ops.choose("avx512", zen3) == "avx2"
    assert "avx512bw" in caplog.text and "lacks" in caplog.text


def test_kernel_build_name_names_the_variant_and_differs_for_other_isa_flags():
    zen3, zen4 = CpuInfo("AMD EPYC", frozenset(ZEN3.split())), CpuInfo("AMD EPYC", frozenset(ZEN4.split()))
    assert cpu_ops.build_name("avx2", zen3).startswith(f"conveyor_avx2_{zen3.flags_digest()}_")
    assert cpu_ops.build_name("avx2", zen3) != cpu_ops.build_name("avx2", zen4)
    assert cpu_ops.build_name("avx2", zen4) != cpu_ops.build_name("portable", zen4)


def test_a_gemm_plan_saved_on_a_cpu_with_other_flags_is_not_reused(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(gemm_store, "_memory", {})
    monkeypatch.setattr(gemm, "this_cpu", lambda: CpuInfo("AMD EPYC", frozenset(ZEN4.split())))
    store = gemm.PlanStore(tmp_path)
    store.put(gemm.key(48, 32, torch.float32, 4, gemm.offered(False)), gemm.PlanEntry(("packed",) * 4))
    store.save()
    monkeypatch.setattr(gemm_store, "_memory", {})  # a new process, on a CPU of the same name without AVX-512
    monkeypatch.setattr(gemm, "this_cpu", lambda: CpuInfo("AMD EPYC", frozenset(ZEN3.split())))
    assert gemm.PlanStore(tmp_path).get(gemm.key(48, 32, torch.float32, 4, gemm.offered(False))) is None


def test_a_gemm_plan_measured_with_other_kernel_sources_is_not_reused(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(gemm_store, "_memory", {})
    store = gemm.PlanStore(tmp_path)
    store.put(gemm.key(48, 32, torch.float32, 4, gemm.offered(False)), gemm.PlanEntry(("panel",) * 4))
    store.save()
    monkeypatch.setattr(gemm_store, "_memory", {})  # a new process, its kernels built from changed sources
    _change_kernel_sources(tmp_path, monkeypatch)
    assert gemm.PlanStore(tmp_path).get(gemm.key(48, 32, torch.float32, 4, gemm.offered(False))) is None


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_a_gemm_plan_measured_with_another_kernel_variant_is_not_reused(tmp_path, monkeypatch, isa):
    import torch

    kernels = ("linear", "packed")  # the same offer under both variants: only the variant differs
    monkeypatch.setattr(gemm_store, "_memory", {})
    monkeypatch.setattr(cpu_ops, "_active", {"isa": "avx512"})
    store = gemm.PlanStore(tmp_path)
    store.put(gemm.key(48, 32, torch.float32, 4, kernels), gemm.PlanEntry(("packed",) * 4))
    store.save()
    monkeypatch.setattr(gemm_store, "_memory", {})  # a new process on the same CPU, its kernels forced to `isa`
    monkeypatch.setattr(cpu_ops, "_active", {"isa": isa})
    assert gemm.PlanStore(tmp_path).get(gemm.key(48, 32, torch.float32, 4, kernels)) is None


@pytest.mark.parametrize(
    ("variable", "value"),
    [("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_ENABLE_INSTRUCTIONS", "AVX2")],
)
def test_a_gemm_plan_measured_with_the_libraries_held_to_another_isa_is_not_reused(
    tmp_path, monkeypatch, variable, value
):
    import torch

    kernels = ("linear", "packed")
    monkeypatch.setattr(gemm_store, "_memory", {})
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    before = gemm.key(48, 32, torch.float32, 4, kernels)
    monkeypatch.setenv(variable, value)  # read by torch, oneDNN, MKL at their start: a worker started so
    assert gemm.key(48, 32, torch.float32, 4, kernels) != before


def test_kernel_build_name_differs_for_other_kernel_sources(tmp_path, monkeypatch):
    zen4 = CpuInfo("AMD EPYC", frozenset(ZEN4.split()))
    before = cpu_ops.build_name("avx512", zen4)
    _change_kernel_sources(tmp_path, monkeypatch)
    assert cpu_ops.build_name("avx512", zen4) != before


def test_every_file_of_the_kernels_sources_is_in_their_digest():
    """A source left out of the digest would leave the builds and plans of its old code in use after an edit."""
    on_disk = {p for p in cpu_ops.CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk <= set(cpu_ops.SOURCES + cpu_ops.HEADERS)


def test_kernel_build_name_differs_for_the_same_sources_in_another_checkout(tmp_path, monkeypatch):
    """Two checkouts (or venvs) on one machine share ~/.cache/conveyor: torch's build files name the sources' and
    torch's paths, so one folder for both made each rebuild the other's kernels at every start (60 s a worker
    start on the Xeon VM, 2026-12-05)."""
    zen4 = CpuInfo("AMD EPYC", frozenset(ZEN4.split()))
    before = cpu_ops.build_name("avx512", zen4)
    copies = []
    for src in cpu_ops.SOURCES:
        copies.append(tmp_path / src.name)
        copies[-1].write_bytes(src.read_bytes())
    monkeypatch.setattr(cpu_ops, "SOURCES", tuple(copies))  # the same bytes, so the same sources digest
    assert cpu_ops.build_name("avx512", zen4) != before


def _change_kernel_sources(tmp_path, monkeypatch) -> None:
    """The kernels' sources as if one had been edited (the digest of them computed afresh)."""
    edited = tmp_path / "edited.cpp"
    edited.write_text("// a kernel changed since\n")
    monkeypatch.setattr(cpu_ops, "HEADERS", (*cpu_ops.HEADERS, edited))
    if (digest := getattr(cpu_ops, "sources_digest", None)) is not None:  # cached: a fresh one, for this test
        monkeypatch.setattr(cpu_ops, "sources_digest", functools.cache(digest.__wrapped__))


def test_others_busy_is_the_machines_busy_time_less_this_processs_over_all_cores():
    before = CpuSample(machine_busy_s=100.0, own_s=10.0, wall_s=50.0)
    after = CpuSample(machine_busy_s=104.0, own_s=12.0, wall_s=52.0)  # 2 s wall, 4 cores: 8 core-seconds
    assert others_busy(before, after, cores=4) == pytest.approx(2.0 / 8)
    assert others_busy(None, after, cores=4) is None


@pytest.mark.parametrize(
    ("entry", "others_now", "expected"),
    [
        (None, None, True),  # no plan yet: measured whatever the load
        (gemm.PlanEntry(("linear",), others_busy=0.05), 0.0, False),  # measured quiet: final
        (gemm.PlanEntry(("linear",), others_busy=None), 0.0, False),  # load unknown: kept
        (gemm.PlanEntry(("linear",), others_busy=0.6), 0.1, True),  # measured loaded, quiet now: again
        (gemm.PlanEntry(("linear",), others_busy=0.6), 0.5, False),  # still loaded now: wait for a quiet start
        (gemm.PlanEntry(("linear",), others_busy=0.6), None, False),  # load now unknown: not judged quiet
        (gemm.PlanEntry(("linear",), others_busy=0.6, tries=gemm.MAX_TRIES), 0.0, False),  # tries spent: kept
    ],
    ids=["missing", "quiet", "unknown", "loaded-now-quiet", "loaded-still-loaded", "loaded-now-unknown", "spent"],
)
def test_a_plan_is_measured_again_only_if_measured_under_load_with_tries_left_and_quiet_now(
    entry, others_now, expected
):
    assert gemm.needs_measuring(entry, others_now) is expected


def test_the_gemm_plan_file_keeps_only_the_newest_plans(tmp_path, monkeypatch):
    """Each change of the kernels' sources, CPU or thread count keys new plans; the file must not grow with them
    forever (it is read at every worker's start). The newest MAX_PLANS written are kept, a re-measured plan counts
    as new."""
    monkeypatch.setattr(gemm_store, "_memory", {})
    monkeypatch.setattr(gemm_store, "MAX_PLANS", 4, raising=False)
    store = gemm.PlanStore(tmp_path)
    for i in range(6):
        store.put(f"key{i}", gemm.PlanEntry(("packed",)))
    store.put("key1", gemm.PlanEntry(("panel",), tries=2))  # measured again: the newest now
    store.save()
    monkeypatch.setattr(gemm_store, "_memory", {})  # a new process reads the file
    again = gemm.PlanStore(tmp_path)
    assert [k for k in ("key0", "key1", "key2", "key3", "key4", "key5") if again.get(k)] == [
        "key1",
        "key3",
        "key4",
        "key5",
    ]
    assert again.get("key1") == gemm.PlanEntry(("panel",), tries=2)


def test_kernel_builds_beyond_the_most_recently_used_are_removed_and_the_one_loaded_is_kept(tmp_path):
    """Every edit of the kernels' sources adds a build of each variant (~2 MB): the cache keeps the builds last
    loaded, not every build ever made."""
    kernels = tmp_path / "kernels"
    builds = [kernels / f"conveyor_avx2_x_{i:02d}" for i in range(cpu_ops.KEPT_BUILDS + 3)]
    for age, build in enumerate(reversed(builds)):  # builds[0] the least recently used
        build.mkdir(parents=True)
        (build / "lib.so").write_bytes(b"x")
        os.utime(build, (1_000_000 - age, 1_000_000 - age))
    other = kernels / "not-a-build"
    other.mkdir()
    cpu_ops.prune_builds(kernels, builds[0].name)
    kept = sorted(p.name for p in kernels.iterdir())
    assert kept == sorted([builds[0].name, *(b.name for b in builds[-(cpu_ops.KEPT_BUILDS - 1) :]), other.name])
