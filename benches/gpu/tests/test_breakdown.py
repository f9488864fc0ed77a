"""breakdown.py and gemm_shapes.py without a GPU (Python 3 standard library only):

    python3 -B -m unittest discover -s benches/gpu/tests

The fixtures in ../testdata are Nsight Compute raw CSVs of the same synthetic step, with kernel
names of ours and of PyTorch, after two kernels that run once per process (weight
initialisation, the check of the weights): ncu-1-step.csv holds one step, ncu-3-steps.csv three.
One step's kernels take 14.5 ms: GEMM 7.0, attention 3.0, norms and elementwise 0.8, loss head
1.0, optimizer 2.0, copies and casts 0.5, other 0.2. run.json is a probe line (2 × 1024 tokens,
N = 1e9, 20 ms a step), metrics.jsonl a train --metrics file (12.5 ms after three slow steps),
gemm.json what gemm_shapes.py writes, cut down to its totals. gemm_shapes.py's timing runs
against a stand-in for torch that checks the operands' shapes.
"""

import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
GPU = os.path.dirname(HERE)
DATA = os.path.join(GPU, "testdata")
sys.path.insert(0, GPU)
sys.dont_write_bytecode = True

import breakdown  # noqa: E402
import gemm_shapes  # noqa: E402

STEP_MS = {"GEMM": 7.0, "attention": 3.0, "norms and elementwise": 0.8, "loss head": 1.0,
           "optimizer": 2.0, "copies and casts": 0.5, "other": 0.2}


def data(name):
    return os.path.join(DATA, name)


def side_args(**over):
    """The arguments of `breakdown.py side` on the fixtures."""
    args = dict(name="ours", ncu=[(data("ncu-1-step.csv"), "1"), (data("ncu-3-steps.csv"), "3")],
                run_json=data("run.json"), metrics=None, skip=4, params=None,
                tokens_per_step=None, peak_flops=989e12, gemm_shapes=None, gemm_layout=None,
                top=25, json=None)
    args.update(over)
    return SimpleNamespace(**args)


class Classification(unittest.TestCase):
    CASES = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
        "execute_segment_k_off_kernel__5x_cublas": "GEMM",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "GEMM",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "GEMM",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_"
        "align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_nn_align8::Params)": "GEMM",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "GEMM",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn": "GEMM",
        "flash_fwd_h64_bf16": "attention",
        "flash_bwd_dkdv_h128_bf16": "attention",
        "softmax_fwd_warp_bf16": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_"
        "traits<64, 128, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>>(Flash_bwd_params)":
            "attention",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
        "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)":
            "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_4x1x1_"
        "kernel0_0": "attention",
        "void cudnn::fmha_reduce_head<1>(...)": "attention",
        "void cudnn::compute_dot_do_o_specialized<1, 64>(...)": "attention",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, "
        "c10::BFloat16, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(...)":
            "attention",
        "ce_fwd_bf16": "loss head",
        "ce_bwd_f32": "loss head",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)":
            "loss head",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, "
        "long>(float*, float*, float const*, long const*, float const*, bool, long, long, long, "
        "long)": "loss head",
        "adam_multi": "optimizer",
        "adam_first": "optimizer",
        "compact_adam_bf16_u8_f32": "optimizer",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
        "(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
        "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*>(...)":
            "optimizer",
        "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<1>, "
        "at::native::L2NormFunctor<float, 1, 1>, float*, float*>(...)": "optimizer",
        "ln_fwd_bf16": "norms and elementwise",
        "ln_params_final": "norms and elementwise",
        "epilogue_bwd_bf16": "norms and elementwise",
        "swiglu_bwd_bf16": "norms and elementwise",
        "rotary_bf16": "norms and elementwise",
        "badd_bf16": "norms and elementwise",
        "ugelu_bf16": "norms and elementwise",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, 0>"
        "(int, float, float const*, float const*, float const*, float*, float*, float*)":
            "norms and elementwise",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, "
        "float, 32u, 32u, 256u, false, true>(...)": "norms and elementwise",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
        "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, "
        "at::detail::Array<char*, 3>)": "norms and elementwise",
        "void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::"
        "silu_kernel(at::TensorIteratorBase&)::{lambda()#1}>(...)": "norms and elementwise",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}, at::detail::Array<char*, 2>, "
        "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(...)":
            "copies and casts",
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda"
        "(at::TensorIteratorBase&)::{lambda(float)#1}>(...)": "copies and casts",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
        "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, ...)":
            "copies and casts",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
        "namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>(...)": "copies and casts",
        "cast_bf16_f32": "copies and casts",
        "widen_bf16": "copies and casts",
        "accumulate_bf16": "copies and casts",
        "permute_b2": "copies and casts",
        "copy2d_bf16": "copies and casts",
        "embed_fwd_bf16": "other",
        "embed_grad_bf16": "other",
        "fast_sum_f32": "other",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<"
        "float, float, float, float>, unsigned int, float, 4> >(...)": "other",
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, "
        "unsigned int, 2, 2, -2, true>(...)": "other",
        "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>>"
        "(long, ...)": "other",
        "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<"
        "float, 4, at::native::templates::cuda::normal_kernel<at::CUDAGeneratorImpl*>>(...)":
            "other",
        "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float, "
        "float, long>(...)": "other",
        "some_kernel_nobody_knows": "other",
        # torch.compile's Triton kernels: by the ops in their names, else elementwise.
        "triton_poi_fused_add_mul_3": "norms and elementwise",
        "triton_per_fused_native_layer_norm_backward_5": "norms and elementwise",
        "triton_red_fused__log_softmax_backward_data_nll_loss_backward_2": "loss head",
        "triton_poi_fused_embedding_0": "other",
    }

    def test_every_class_by_name(self):
        for name, want in self.CASES.items():
            with self.subTest(name=name[:60]):
                self.assertEqual(breakdown.classify(name), want)

    def test_every_class_is_one_of_the_seven(self):
        for name in self.CASES:
            self.assertIn(breakdown.classify(name), breakdown.CLASSES)

    def test_short_names_lose_the_arguments_not_the_templates(self):
        short = breakdown.short_name(
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<Meta<4>, "
            "F<float, (at::native::ADAM_MODE)1>>(Meta<4>, float*)", width=200)
        self.assertEqual(short, "at::native::<unnamed>::multi_tensor_apply_kernel<Meta<4>, "
                                "F<float, (at::native::ADAM_MODE)1>>")
        self.assertEqual(breakdown.short_name("x" * 200, 10), "x" * 9 + "…")


class PerStep(unittest.TestCase):
    def classes(self, runs):
        per = breakdown.per_step([(breakdown.read_rows(data(p)), s) for p, s in runs])
        return {c: ns / 1e6 for c, (ns, _) in breakdown.by_class(per).items()}

    def test_two_runs_leave_the_one_off_kernels_out(self):
        got = self.classes([("ncu-1-step.csv", 1), ("ncu-3-steps.csv", 3)])
        for cls, ms in STEP_MS.items():
            self.assertAlmostEqual(got[cls], ms, places=9, msg=cls)

    def test_the_order_of_the_two_runs_does_not_matter(self):
        got = self.classes([("ncu-3-steps.csv", 3), ("ncu-1-step.csv", 1)])
        self.assertAlmostEqual(sum(got.values()), 14.5, places=9)

    def test_one_run_counts_its_one_off_kernels_over_its_steps(self):
        got = self.classes([("ncu-3-steps.csv", 3)])
        self.assertAlmostEqual(got["other"], 0.2 + 70.0 / 3, places=9)
        self.assertAlmostEqual(got["GEMM"], 7.0, places=9)

    def test_launches_per_step(self):
        per = breakdown.per_step([(breakdown.read_rows(data("ncu-1-step.csv")), 1),
                                  (breakdown.read_rows(data("ncu-3-steps.csv")), 3)])
        launches = {c: n for c, (_, n) in breakdown.by_class(per).items()}
        self.assertEqual(launches["GEMM"], 4)
        self.assertEqual(sum(launches.values()), 26)

    def test_a_class_below_zero_from_noise_counts_as_zero(self):
        short = [("adam_multi", 1000.0), ("ce_fwd_bf16", 500.0)]
        long_ = [("adam_multi", 1900.0), ("ce_fwd_bf16", 100.0)]
        classes = breakdown.by_class(breakdown.per_step([(short, 1), (long_, 2)]))
        self.assertEqual(classes["loss head"][0], 0.0)
        self.assertAlmostEqual(classes["optimizer"][0], 900.0)

    def test_equal_step_counts_are_refused(self):
        with self.assertRaises(ValueError):
            breakdown.per_step([([("a", 1.0)], 2), ([("a", 2.0)], 2)])

    def test_rows_outside_the_csv_are_ignored(self):
        rows = breakdown.read_rows(data("ncu-1-step.csv"))
        self.assertEqual(len(rows), 2 + 26)  # the units row, ==PROF== lines and JSON are not kernels


class Step(unittest.TestCase):
    def check_shares(self, r):
        shares = [c["share"] for c in r["classes"].values()]
        self.assertTrue(all(s >= 0 for s in shares), shares)
        self.assertAlmostEqual(sum(shares), 1.0, places=12)

    def test_idle_is_the_wall_step_less_the_kernel_time(self):
        r = breakdown.side(side_args())
        self.assertAlmostEqual(r["wall_ms"], 20.0)
        self.assertAlmostEqual(r["kernel_ms"], 14.5)
        self.assertAlmostEqual(r["idle_ms"], 5.5)
        self.assertAlmostEqual(r["classes"]["idle gaps"]["ms"], 5.5)
        self.assertAlmostEqual(r["classes"]["GEMM"]["share"], 0.35)
        self.assertAlmostEqual(r["classes"]["idle gaps"]["share"], 0.275)
        self.assertEqual(r["over_wall_ms"], 0.0)
        self.check_shares(r)

    def test_kernel_time_over_the_wall_step_leaves_no_idle_and_no_negative_share(self):
        r = breakdown.side(side_args(metrics=data("metrics.jsonl"), skip=3))
        self.assertAlmostEqual(r["wall_ms"], 12.5)
        self.assertIn("train --metrics", r["wall_source"])
        self.assertAlmostEqual(r["run_json_wall_ms"], 20.0)
        self.assertEqual(r["idle_ms"], 0.0)
        self.assertAlmostEqual(r["over_wall_ms"], 2.0)
        self.assertAlmostEqual(r["classes"]["GEMM"]["share"], 7.0 / 14.5)
        self.check_shares(r)

    def test_the_metrics_wall_skips_the_warm_up_steps(self):
        seconds, n, first = breakdown.metrics_wall_s(data("metrics.jsonl"), 3, 2048)
        self.assertAlmostEqual(seconds, 0.0125)
        self.assertEqual((n, first), (3, 4))
        seconds, n, _ = breakdown.metrics_wall_s(data("metrics.jsonl"), 0, 2048)
        self.assertAlmostEqual(seconds, (13 + 25) / 2 / 1e3)  # 12, 12.5, 13 | 25, 40, 300

    def test_tokens_per_second_and_mfu(self):
        r = breakdown.side(side_args())
        self.assertEqual(r["tokens_per_step"], 2048)
        self.assertEqual(r["params"], 1_000_000_000)
        self.assertIn("run.json", r["params_source"])
        self.assertAlmostEqual(r["tokens_per_s"], 102_400)
        self.assertAlmostEqual(r["mfu"], 6e9 * 102_400 / 989e12)

    def test_numbers_given_on_the_command_line_win_and_say_so(self):
        r = breakdown.side(side_args(params=500_000_000, tokens_per_step=4096))
        self.assertEqual((r["params_source"], r["tokens_source"]), ("--params", "--tokens-per-step"))
        self.assertAlmostEqual(r["tokens_per_s"], 204_800)

    def test_gemms_against_cublas(self):
        r = breakdown.side(side_args(gemm_shapes=data("gemm.json"), gemm_layout="fused"))
        g = r["gemm"]
        self.assertAlmostEqual(g["at_cublas"], 0.9)
        self.assertAlmostEqual(g["achieved_tflops"], 2.4e12 / 7e-3 / 1e12)
        self.assertAlmostEqual(g["cublas_tflops"], 2.4e12 / 6.3e-3 / 1e12)
        self.assertTrue(g["tokens_match"])
        r = breakdown.side(side_args(gemm_shapes=data("gemm.json"), gemm_layout="separate"))
        self.assertAlmostEqual(r["gemm"]["at_cublas"], 0.8)

    def test_an_unknown_layout_is_an_error(self):
        with self.assertRaises(ValueError):
            breakdown.side(side_args(gemm_shapes=data("gemm.json"), gemm_layout="other"))


class CommandLine(unittest.TestCase):
    def run_py(self, script, *args):
        return subprocess.run([sys.executable, "-B", os.path.join(GPU, script), *args],
                              capture_output=True, text=True)

    def test_side_then_join(self):
        with tempfile.TemporaryDirectory() as tmp:
            ours, torch = os.path.join(tmp, "ours.json"), os.path.join(tmp, "torch.json")
            common = ["--ncu", data("ncu-1-step.csv"), "1", "--ncu", data("ncu-3-steps.csv"), "3",
                      "--run-json", data("run.json"), "--gemm-shapes", data("gemm.json")]
            out = self.run_py("breakdown.py", "side", "--name", "ours", *common, "--json", ours)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("| GEMM | 7.00 | 35.0% | 4 |", out.stdout)
            self.assertIn("| idle gaps | 5.50 | 27.5% |", out.stdout)
            out = self.run_py("breakdown.py", "side", "--name", "pytorch", *common,
                              "--metrics", data("metrics.jsonl"), "--skip", "3", "--json", torch)
            self.assertEqual(out.returncode, 0, out.stderr)
            joined = os.path.join(tmp, "joined.json")
            out = self.run_py("breakdown.py", "join", ours, torch, "--json", joined)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("| | ours ms | ours share | pytorch ms | pytorch share |", out.stdout)
            self.assertIn("| idle gaps | 5.50 | 27.5% | 0.00 | 0.0% |", out.stdout)
            with open(joined) as f:
                doc = json.load(f)
            self.assertEqual([s["name"] for s in doc["sides"]], ["ours", "pytorch"])

    def test_a_csv_without_kernels_is_an_error(self):
        with tempfile.NamedTemporaryFile("w", suffix=".csv") as empty:
            empty.write("==ERROR== ERR_NVGPUCTRPERM\n")
            empty.flush()
            out = self.run_py("breakdown.py", "side", "--name", "x", "--ncu", empty.name, "2",
                              "--run-json", data("run.json"))
        self.assertEqual(out.returncode, 1)
        self.assertIn("no kernel rows", out.stderr)

    def test_kernels_py_reads_the_same_csv(self):
        out = self.run_py("kernels.py", data("ncu-1-step.csv"), "1")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("28 kernels over 1 steps: 84.5 ms", out.stdout)

    def test_gemm_shapes_dry_run(self):
        out = self.run_py("gemm_shapes.py", "--model", "gpt-1.3b", "--micro-batch", "4",
                          "--dry-run")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("| lm head dW | 50257 | 2048 | 4096 | 1 |", out.stdout)


class GemmShapes(unittest.TestCase):
    def flops(self, model, layout, mb):
        s = gemm_shapes.PRESETS[model]
        return sum(gemm_shapes.flops(p) for p in gemm_shapes.products(s, layout, mb * s.seq))

    def test_a_step_is_six_flops_per_weight_and_token(self):
        for model, weights in (
                ("gpt-1.3b", 24 * (2048 * 6144 + 2048 * 2048 + 2 * 2048 * 8192) + 2048 * 50257),
                ("llama-3.2-1b", 16 * (2048 * 3072 + 2048 * 2048 + 3 * 2048 * 8192)
                 + 2048 * 128256)):
            s = gemm_shapes.PRESETS[model]
            with self.subTest(model=model):
                self.assertEqual(self.flops(model, "fused", 3), 6 * 3 * s.seq * weights)

    def test_layouts_differ_in_shapes_not_in_flops(self):
        self.assertEqual(self.flops("llama-3.2-1b", "fused", 3),
                         self.flops("llama-3.2-1b", "separate", 3))
        s = gemm_shapes.PRESETS["llama-3.2-1b"]
        fused = gemm_shapes.products(s, "fused", 6144)
        separate = gemm_shapes.products(s, "separate", 6144)
        self.assertEqual(len(fused), 15)
        self.assertIn((6144, 512, 2048), {(p["m"], p["n"], p["k"]) for p in separate})
        self.assertEqual(sum(p["count"] for p in separate), 3 * (7 * 16 + 1))

    def test_the_three_products_of_a_linear(self):
        s = gemm_shapes.Shape(64, 256, 2, 4, 4, 100, 32, "gelu")
        got = {(p["op"], p["m"], p["n"], p["k"]) for p in gemm_shapes.products(s, "fused", 64)}
        # fc1: 64 -> 256 over 64 tokens
        self.assertTrue({("forward", 64, 256, 64), ("dX", 64, 64, 256), ("dW", 256, 64, 64)} <= got)

    def test_grad_accumulation_multiplies_the_counts(self):
        s = gemm_shapes.PRESETS["gpt-1.3b"]
        one = gemm_shapes.products(s, "fused", 4096)
        four = gemm_shapes.products(s, "fused", 4096, accum=4)
        self.assertEqual([4 * p["count"] for p in one], [p["count"] for p in four])


class FakeTensor:
    """Shapes only: enough of a tensor for gemm_shapes.py's timing loop."""

    def __init__(self, *shape):
        self.shape = tuple(shape)

    def t(self):
        return FakeTensor(*reversed(self.shape))


class FakeEvent:
    """Each record is one millisecond after the one before."""
    clock = 0.0

    def __init__(self, enable_timing):
        self.at = None

    def record(self):
        FakeEvent.clock += 1.0
        self.at = FakeEvent.clock

    def elapsed_time(self, end):
        return end.at - self.at


def fake_torch(launches):
    """A stand-in for torch that checks every product's operands and records its shape."""
    def matmul(a, b, out):
        assert a.shape[1] == b.shape[0], (a.shape, b.shape)
        assert out.shape == (a.shape[0], b.shape[1]), (out.shape, a.shape, b.shape)
        launches.append((a.shape[0], b.shape[1], a.shape[1]))

    def tensor(*shape, device, dtype):
        return FakeTensor(*shape)

    cuda = SimpleNamespace(is_available=lambda: True, Event=FakeEvent, synchronize=lambda: None,
                           empty_cache=lambda: None, get_device_name=lambda: "stand-in")
    return SimpleNamespace(bfloat16="bf16", __version__="0-stand-in", randn=tensor, empty=tensor,
                           matmul=matmul, cuda=cuda)


class GemmTiming(unittest.TestCase):
    def test_every_shape_is_timed_once_with_operands_that_fit(self):
        launches = []
        with mock.patch.dict(sys.modules, {"torch": fake_torch(launches)}), \
                mock.patch.object(gemm_shapes, "spin_up", lambda torch: None), \
                tempfile.TemporaryDirectory() as tmp, \
                mock.patch("sys.stdout", new_callable=io.StringIO) as out:
            path = os.path.join(tmp, "gemm.json")
            gemm_shapes.main(["--model", "llama-3.2-1b", "--micro-batch", "3", "--warmup", "2",
                              "--reps", "20", "--json", path])
            with open(path) as f:
                doc = json.load(f)
        fused, separate = doc["layouts"]["fused"], doc["layouts"]["separate"]
        shapes = {(p["op"], p["m"], p["n"], p["k"]) for p in fused["products"] + separate["products"]}
        self.assertEqual(len(launches), 22 * len(shapes))  # each shape once: 2 warm-up + 20 timed
        self.assertEqual({(m, n, k) for _, m, n, k in shapes}, set(launches))
        for entry in (fused, separate):
            self.assertTrue(all(p["ms"] == 1.0 for p in entry["products"]))
            self.assertEqual(entry["cublas_ms_per_step"], sum(p["count"] for p in entry["products"]))
        self.assertEqual(doc["tokens_per_step"], 6144)
        self.assertIn("| lm head dW | 128256 | 2048 | 6144 | 1 | 1.000 |", out.getvalue())


if __name__ == "__main__":
    unittest.main()
