# ruff: noqa: E501 (HLO text lines are as long as XLA prints them)
"""flaxgpt.aot.hlo_cost: kernels counted with their loops' trip counts, in-place updates and slices
costed by the bytes they touch, matmul FLOPs from the dot shapes, a conditional by its largest branch
(or its smallest)."""

import pytest

from flaxgpt.aot import hlo_cost

# a hand-written optimized module: a loop of 12 trips whose body multiplies a [64, 32] slice of a
# stacked [12, 64, 32] buffer by a [32, 16] matrix and writes the result into a stacked output in place
HLO = """
HloModule m

%dot_computation (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %d = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%slice_computation (s0: bf16[12,64,32], s1: s32[]) -> bf16[64,32] {
  %s0 = bf16[12,64,32]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,64,32]{2,1,0} dynamic-slice(%s0, %s1, %z, %z), dynamic_slice_sizes={1,64,32}
  ROOT %b = bf16[64,32]{1,0} bitcast(%ds)
}

%update_computation (u0: bf16[12,64,16], u1: bf16[1,64,16], u2: s32[]) -> bf16[12,64,16] {
  %u0 = bf16[12,64,16]{2,1,0} parameter(0)
  %u1 = bf16[1,64,16]{2,1,0} parameter(1)
  %u2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = bf16[12,64,16]{2,1,0} dynamic-update-slice(%u0, %u1, %u2, %z, %z)
}

%body (t: (s32[], bf16[12,64,32], bf16[32,16], bf16[12,64,16])) -> (s32[], bf16[12,64,32], bf16[32,16], bf16[12,64,16]) {
  %t = (s32[], bf16[12,64,32]{2,1,0}, bf16[32,16]{1,0}, bf16[12,64,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[12,64,32]{2,1,0} get-tuple-element(%t), index=1
  %w = bf16[32,16]{1,0} get-tuple-element(%t), index=2
  %y = bf16[12,64,16]{2,1,0} get-tuple-element(%t), index=3
  %sl = bf16[64,32]{1,0} fusion(%x, %i), kind=kLoop, calls=%slice_computation
  %mm = bf16[64,16]{1,0} fusion(%sl, %w), kind=kCustom, calls=%dot_computation
  %r = bf16[1,64,16]{2,1,0} bitcast(%mm)
  %up = bf16[12,64,16]{2,1,0} fusion(%y, %r, %i), kind=kLoop, calls=%update_computation
  %one = s32[] constant(1)
  %n = s32[] add(%i, %one)
  ROOT %o = (s32[], bf16[12,64,32]{2,1,0}, bf16[32,16]{1,0}, bf16[12,64,16]{2,1,0}) tuple(%n, %x, %w, %up)
}

%cond (c: (s32[], bf16[12,64,32], bf16[32,16], bf16[12,64,16])) -> pred[] {
  %c = (s32[], bf16[12,64,32]{2,1,0}, bf16[32,16]{1,0}, bf16[12,64,16]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(12)
  ROOT %lt = pred[] compare(%ci, %k), direction=LT
}

%small (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %neg = f32[8]{0} negate(%a)
}

%big (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %e = f32[8]{0} exponential(%a)
  ROOT %l = f32[8]{0} log(%e)
}

ENTRY %main (x: bf16[12,64,32], w: bf16[32,16], y: bf16[12,64,16], p: s32[], v: f32[8]) -> bf16[12,64,16] {
  %x = bf16[12,64,32]{2,1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %y = bf16[12,64,16]{2,1,0} parameter(2)
  %p = s32[] parameter(3)
  %v = f32[8]{0} parameter(4)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[12,64,32]{2,1,0}, bf16[32,16]{1,0}, bf16[12,64,16]{2,1,0}) tuple(%zero, %x, %w, %y)
  %loop = (s32[], bf16[12,64,32]{2,1,0}, bf16[32,16]{1,0}, bf16[12,64,16]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %branch = f32[8]{0} conditional(%p, %v, %v), branch_computations={%small, %big}
  ROOT %out = bf16[12,64,16]{2,1,0} get-tuple-element(%loop), index=3
}
"""


def test_loop_trips_in_place_updates_slices_and_branches():
    cost = hlo_cost.estimate(HLO, peak_flops=1e12, bandwidth=1e9)
    by = {k.name: k for k in cost.by_kernel}
    # 3 kernels x 12 trips + the loop counter's add x 12 + the largest branch's two kernels
    assert by["mm"].count == by["sl"].count == by["up"].count == by["n"].count == 12
    assert {"e", "l"} <= set(by) and "neg" not in by
    assert cost.kernels == 4 * 12 + 2
    assert by["mm"].flops == 2 * 64 * 16 * 32
    assert cost.matmul_flops == 12 * 2 * 64 * 16 * 32
    # the slice reads one [64, 32] layer (not the stacked 12) and writes it
    assert by["sl"].bytes == 2 * 64 * 32 * 2 + 4
    # the in-place update reads its [1, 64, 16] slice and writes only that
    assert by["up"].bytes == 2 * 64 * 16 * 2 + 4
    assert by["mm"].bytes == (64 * 32 + 32 * 16 + 64 * 16) * 2
    # each kernel its own roofline, summed over launches: the memory-bound ones at 1 GB/s
    assert cost.bound_s == pytest.approx(
        sum(k.count * max(k.flops / 1e12, k.bytes / 1e9) for k in cost.by_kernel)
    )
    assert cost.memory_bound_s == pytest.approx(cost.bound_s)
    assert cost.top(1)[0].name in ("mm", "sl", "up")
    # branch=min: the smallest branch stands for the conditional (a skip branch: what runs when no row
    # needs the pass), the loop as before
    fewest = {k.name: k for k in hlo_cost.estimate(HLO, 1e12, 1e9, branch=min).by_kernel}
    assert "neg" in fewest and not {"e", "l"} & set(fewest) and fewest["mm"].count == 12


def test_the_loop_body_is_a_token_and_costs_one_trip():
    """loop_body: the entry's one while loop's body (a decode call's token loop); costed alone, one trip
    of its kernels (the three and the counter's add); no while loop, or two, is one line."""
    assert hlo_cost.loop_body(HLO) == "body"
    assert hlo_cost.estimate(HLO, 1e12, 1e9, computation="body").kernels == 4
    with pytest.raises(ValueError, match=r"^the entry computation has 0 while loops, not one$"):
        hlo_cost.loop_body(HLO.replace("while(%init)", "tuple(%init)"))


def test_a_loop_without_known_trip_count_reads_its_condition_or_counts_once():
    """TPU programs carry no known_trip_count: `counter < 12` from a start of 0 is 12 trips (a start of
    2: 10); a condition that is not a counter against a constant (decoding until every row stops)
    counts once: the figures are per iteration."""
    tpu = HLO.replace(', backend_config={"known_trip_count":{"n":"12"}}', "")
    assert hlo_cost.estimate(tpu, 1e12, 1e9).kernels == 4 * 12 + 2
    later = tpu.replace("%zero = s32[] constant(0)", "%zero = s32[] constant(2)")
    assert hlo_cost.estimate(later, 1e12, 1e9).kernels == 4 * 10 + 2
    unknown = tpu.replace("%k = s32[] constant(12)", "%k = s32[] get-tuple-element(%c), index=0")
    assert hlo_cost.estimate(unknown, 1e12, 1e9).kernels == 4 + 2
