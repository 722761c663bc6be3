"""The profile's kinds (`benchmarks/bench_online.py --profile`): kernel and operator names as the
profiler reports them, each in the kind a change would target, and the table summed per step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from dflashkit.bench.profile import Entry, busy_us, device_entries, format_table, kernel_kind, kind_table, short_name

NAMES = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matmul"),
    ("aten::mm", "matmul"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>",
     "attention"),
    ("triton_tem_fused_0", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gated_deltanet"),
    ("triton_chunk_scaled_dot_kkt_fwd_kernel", "gated_deltanet"),
    ("fused_recurrent_gated_delta_rule_fwd_kernel", "gated_deltanet"),
    ("aten::linalg_solve_triangular", "gated_deltanet"),
    ("causal_conv1d_fwd_kernel", "conv1d"),
    ("aten::_conv_depthwise2d", "conv1d"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "conv1d"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, ...)", "elementwise"),
    ("aten::silu_backward", "elementwise"),
    ("aten::masked_fill_", "elementwise"),
    ("triton_poi_fused__to_copy_add_mul_0", "elementwise"),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_1", "elementwise"),
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>", "elementwise"),
    ("triton_per_fused__log_softmax_nll_loss_forward_2", "reduction"),
    ("triton_red_fused_sum_3", "reduction"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "reduction"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
     "reduction"),
    ("Memcpy HtoD (Pinned -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
     "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<2u>, unsigned int, 3, 128, 1>", "copy"),
    ("aten::copy_", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul>>",
     "copy"),
    ("void at::native::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>", "indexing"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>>", "indexing"),
    ("aten::embedding", "indexing"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("aten::_foreach_mul_", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_AllGather_RING_LL", "communication"),
    ("c10d::allreduce_", "communication"),
    ("aten::empty", "other"),
    ("cudaLaunchKernel", "other"),
]


@pytest.mark.parametrize("name,kind", NAMES)
def test_kernel_kind_puts_each_name_in_the_kind_a_change_would_target(name: str, kind: str):
    assert kernel_kind(name) == kind


def test_kind_table_sums_per_step_and_keeps_the_heaviest_first():
    entries = [Entry("ampere_bf16_s16816gemm_a", 6000.0, 20), Entry("nvjet_tst_b", 2000.0, 10),
               Entry("flash_fwd_kernel", 1000.0, 4), Entry("Memcpy HtoD (Pinned -> Device)", 500.0, 8),
               Entry("void mystery_kernel", 500.0, 2)]
    rows = kind_table(entries, steps=2, top=1)
    assert [r["kind"] for r in rows] == ["matmul", "attention", "copy", "other"]
    mm = rows[0]
    assert mm["ms_per_step"] == 4.0 and mm["count_per_step"] == 15 and mm["share"] == 0.8
    assert mm["top"] == [{"name": "ampere_bf16_s16816gemm_a", "ms_per_step": 3.0, "count_per_step": 10}]
    assert rows[-1]["top"][0]["name"] == "mystery_kernel"  # 'void ' dropped
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    text = format_table({"kinds": rows, "activity": "test", "summed_ms_per_step": 5.0,
                         "device_busy_ms_per_step": 4.0, "steps": 2})
    assert text.splitlines()[1].startswith("matmul") and "80.0%" in text.splitlines()[1]


def test_busy_counts_overlapping_kernels_once():
    assert busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert busy_us([]) == 0


def test_short_name_cuts_long_template_names():
    assert short_name("void " + "k" * 300, width=50) == "k" * 47 + "..."


def test_device_entries_sum_the_device_events_by_name_and_leave_host_events_and_annotations_out():
    def event(name: str, device: DeviceType, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
        span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
        return SimpleNamespace(name=name, device_type=device, time_range=span, is_user_annotation=annotation)

    # a `record_function` range shows on the device's timeline too, over kernels counted already
    events = [event("aten::mm", DeviceType.CPU, 0, 50), event("nvjet_a", DeviceType.CUDA, 10, 30),
              event("Memcpy HtoD (Pinned -> Device)", DeviceType.CUDA, 20, 40), event("nvjet_a", DeviceType.CUDA, 60, 70),
              event("Optimizer.step#HostAdamW.step", DeviceType.CUDA, 0, 100, annotation=True)]
    prof = SimpleNamespace(events=lambda: events)
    entries, busy = device_entries(prof)
    assert sorted(entries) == [Entry("Memcpy HtoD (Pinned -> Device)", 20, 1), Entry("nvjet_a", 30, 2)]
    assert busy == 40
