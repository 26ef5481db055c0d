class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1, arg15_1, arg16_1, arg17_1, arg18_1 = args
        args.clear()
        s72 = arg1_1
        s18 = arg7_1
        s7 = arg18_1
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf16 = empty_strided_cuda((s18, 32), (32, 1), torch.bfloat16)
            buf17 = empty_strided_cuda((s18, 32), (32, 1), torch.bfloat16)
            buf1 = empty_strided_cuda((16*s18, 128), (128, 1), torch.bfloat16)
            # Unsorted Source Nodes: [], Original ATen: []
            triton_poi_fused_0_xnumel = 32*s18
            stream0 = get_raw_stream(0)
            triton_poi_fused_0.run(arg17_1, arg16_1, buf16, buf17, s7, triton_poi_fused_0_xnumel, stream=stream0)
            # Unsorted Source Nodes: [], Original ATen: []
            triton_per_fused_1_xnumel = 16*s18
            stream0 = get_raw_stream(0)
            triton_per_fused_1.run(arg0_1, arg3_1, arg2_1, buf1, triton_per_fused_1_xnumel, 128, stream=stream0)
            del arg0_1
            del arg16_1
            del arg17_1
            del arg2_1
            del arg3_1
            buf2 = empty_strided_cuda((s18, 2048), (2048, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [reshape, float_1, pow_1, mean, add, rsqrt, mul, float_2, mul_1, reshape_1, float_3, silu, mul_2, to, flatten, linear], Original ATen: [aten.view, aten._to_copy, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.clone, aten._unsafe_view, aten.silu, aten.t, aten.mm]
            triton_poi_fused__to_copy__unsafe_view_add_clone_mean_mm_mul_pow_rsqrt_silu_t_view_2_xnumel = 2048*s18
            stream0 = get_raw_stream(0)
            triton_poi_fused__to_copy__unsafe_view_add_clone_mean_mm_mul_pow_rsqrt_silu_t_view_2.run(buf1, buf2, s18, triton_poi_fused__to_copy__unsafe_view_add_clone_mean_mm_mul_pow_rsqrt_silu_t_view_2_xnumel, stream=stream0)
            del buf1
            buf3 = empty_strided_cuda((s18, 1024), (1024, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [reshape, float_1, pow_1, mean, add, rsqrt, mul, float_2, mul_1, reshape_1, float_3, silu, mul_2, to, flatten, linear], Original ATen: [aten.view, aten._to_copy, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.clone, aten._unsafe_view, aten.silu, aten.t, aten.mm]
            extern_kernels.mm(buf2, reinterpret_tensor(arg5_1, (2048, 1024), (1, 2048), 0), out=buf3)
            del arg5_1
            del buf2
            buf5 = empty_strided_cuda((s18, 1024), (1024, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [float_4, add_1, fused_add_rms_norm_default], Original ATen: [aten._to_copy, aten.add, vllm_ir.fused_add_rms_norm]
            stream0 = get_raw_stream(0)
            triton_per_fused__to_copy_add_fused_add_rms_norm_3.run(buf3, arg9_1, arg8_1, buf5, s18, 1024, stream=stream0)
            del arg8_1
            buf6 = empty_strided_cuda((s18, 7168), (7168, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [float_4, add_1, fused_add_rms_norm_default, linear_1], Original ATen: [aten._to_copy, aten.add, vllm_ir.fused_add_rms_norm, aten.t, aten.mm]
            extern_kernels.mm(buf5, reinterpret_tensor(arg10_1, (1024, 7168), (1, 1024), 0), out=buf6)
            del arg10_1
            del buf5
            buf7 = empty_strided_cuda((s18, 3584), (3584, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [getitem_2, silu_1, getitem_3, mul_3], Original ATen: [aten.slice, aten.silu, aten.mul]
            triton_poi_fused_mul_silu_slice_4_xnumel = 3584*s18
            stream0 = get_raw_stream(0)
            triton_poi_fused_mul_silu_slice_4.run(buf6, buf7, triton_poi_fused_mul_silu_slice_4_xnumel, stream=stream0)
            del buf6
            buf8 = empty_strided_cuda((s18, 1024), (1024, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [getitem_2, silu_1, getitem_3, mul_3, linear_2], Original ATen: [aten.slice, aten.silu, aten.mul, aten.t, aten.mm]
            extern_kernels.mm(buf7, reinterpret_tensor(arg11_1, (3584, 1024), (1, 3584), 0), out=buf8)
            del arg11_1
            del buf7
            buf9 = empty_strided_cuda((s18, 1024), (1024, 1), torch.bfloat16)
            buf12 = empty_strided_cuda((s18, 1024), (1024, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [fused_add_rms_norm_default, float_5, add_2, fused_add_rms_norm_default_1], Original ATen: [vllm_ir.fused_add_rms_norm, aten._to_copy, aten.add, aten.copy_]
            stream0 = get_raw_stream(0)
            triton_per_fused__to_copy_add_copy__fused_add_rms_norm_5.run(buf8, buf3, arg9_1, arg12_1, buf9, buf12, arg6_1, s18, 1024, stream=stream0)
            del arg12_1
            del arg6_1
            del arg9_1
            del buf3
            buf11 = buf8; del buf8  # reuse
            buf13 = empty_strided_cuda((s18, 5120), (5120, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [fused_add_rms_norm_default, float_5, add_2, fused_add_rms_norm_default_1, linear_3], Original ATen: [vllm_ir.fused_add_rms_norm, aten._to_copy, aten.add, aten.t, aten.mm]
            extern_kernels.mm(buf12, reinterpret_tensor(arg13_1, (1024, 5120), (1, 1024), 0), out=buf13)
            del arg13_1
            del buf12
            buf14 = empty_strided_cuda((s18, 8, 256), (2048, 256, 1), torch.bfloat16)
            buf15 = empty_strided_cuda((s18, 8, 1), (8, 1, 8*s18), torch.float32)
            buf21 = empty_strided_cuda((s18, 2, 1), (2, 1, 2*s18), torch.float32)
            # Topologically Sorted Source Nodes: [split, view, chunk, reshape_4, reshape_3, rms_norm_default, view_3, rms_norm_default_1], Original ATen: [aten.split_with_sizes, aten.view, aten.split, aten.clone, vllm_ir.rms_norm]
            triton_poi_fused_6_xnumel = 2048*s18
            stream0 = get_raw_stream(0)
            triton_poi_fused_6.run(buf13, buf14, triton_poi_fused_6_xnumel, stream=stream0)
            # Topologically Sorted Source Nodes: [split, view, chunk, reshape_4, reshape_3, rms_norm_default, view_3, rms_norm_default_1], Original ATen: [aten.split_with_sizes, aten.view, aten.split, aten.clone, vllm_ir.rms_norm]
            triton_red_fused_7_xnumel_0 = 8*s18
            triton_red_fused_7_xnumel_1 = 2*s18
            stream0 = get_raw_stream(0)
            triton_red_fused_7.run(buf13, buf15, buf21, triton_red_fused_7_xnumel_0, triton_red_fused_7_xnumel_1, stream=stream0)
            buf20 = empty_strided_cuda((s18, 8, 256), (2048, 256, 1), torch.bfloat16)
            buf18 = reinterpret_tensor(buf20, (s18, 8, 64), (2048, 256, 1), 0)  # alias
            buf19 = reinterpret_tensor(buf20, (s18, 8, 192), (2048, 256, 1), 64)  # alias
            buf24 = empty_strided_cuda((s18, 2, 256), (512, 256, 1), torch.bfloat16)
            buf22 = reinterpret_tensor(buf24, (s18, 2, 64), (512, 256, 1), 0)  # alias
            buf23 = reinterpret_tensor(buf24, (s18, 2, 192), (512, 256, 1), 64)  # alias
            # Topologically Sorted Source Nodes: [split, view, chunk, reshape_3, float_6, add_3, rms_norm_default, getitem_20, chunk_2, mul_4, mul_5, sub, mul_6, mul_7, add_5, cat, getitem_21, cat_1, view_3, float_7, add_4, rms_norm_default_1, getitem_24, chunk_3, mul_8, mul_9, sub_1, mul_10, mul_11, add_6, cat_2, getitem_25, cat_3], Original ATen: [aten.split_with_sizes, aten.view, aten.split, aten.clone, aten._to_copy, aten.add, vllm_ir.rms_norm, aten.slice, aten.unsqueeze, aten.mul, aten.sub, aten.cat]
            triton_poi_fused_8_xnumel_0 = 512*s18
            triton_poi_fused_8_xnumel_1 = 1536*s18
            triton_poi_fused_8_xnumel_2 = 128*s18
            triton_poi_fused_8_xnumel_3 = 384*s18
            stream0 = get_raw_stream(0)
            triton_poi_fused_8.run(buf13, buf15, arg14_1, buf16, buf17, buf21, arg15_1, buf18, buf19, buf22, buf23, triton_poi_fused_8_xnumel_0, triton_poi_fused_8_xnumel_1, triton_poi_fused_8_xnumel_2, triton_poi_fused_8_xnumel_3, stream=stream0)
            del arg14_1
            del arg15_1
            del buf15
            del buf16
            del buf17
            del buf21
            buf25 = empty_strided_cuda((s18, 2048), (2048, 1), torch.bfloat16)
        return (buf24, reinterpret_tensor(buf13, (s18, 2, 256), (5120, 256, 1), 4608), buf20, reinterpret_tensor(buf25, (s18, 8, 256), (2048, 256, 1), 0), reinterpret_tensor(buf14, (s18, 2048), (2048, 1), 0), buf11, buf9, )

runner = Runner(partitions=[])
