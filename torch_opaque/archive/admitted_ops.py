"""The operators a program loaded from a file may call, by family: data only.

Note [Admitted operator families]
A loaded graph runs each operator it names with arguments from the file
(sizes, dims, indices, dtypes, and tensors of any value), so an operator is
admitted only when its kernel checks those arguments itself: an operator
that is not listed here is refused at load (Note [Operators a loaded program
may call] in op_policy.py), whatever a later PyTorch release adds. Each
family says in one line why its kernels are safe with hostile arguments;
tests/archive/test_archive_op_fuzz.py calls every admitted operator with
hostile arguments (out-of-range and huge indices, negative and huge sizes,
empty, expanded and overlapping tensors, wrong dtypes) in child processes,
and checks that every family here has fuzz cases. docs/shipping.md's list of
admitted families is generated from this table (``family_table_markdown``)
and a test compares them.

A name admits its overloads except the ``out=`` ones (an argument the schema
marks as an output: ``add.out``, ``reflection_pad1d_backward.grad_input``;
torch.export writes the functional overload, and an ``out=`` overload resizes
the tensor it is given); a family with ``in_place`` also admits each
name's in-place form (``add_``), whose writes Note [Writes a loaded program
may make] bounds. The seed was what torch.export, ``run_decompositions()``
and the stored programs of self-contained archives write for the round-trip
corpus, the test fixtures and the docs' examples, plus torch's core ATen
operator set and the training-IR forms of the common ``nn`` layers. The fuzz
took off the list the operators it crashed (``_cummax_helper``,
``_cummin_helper``, ``_stack``, ``_weight_norm_interface_backward``,
``_foreach_copy``, the ``embedding_bag`` family, ``_fft_r2c`` with dims past
the input's rank and its siblings ``_fft_c2r``/``_fft_c2c``,
the ``reflection_pad*_backward`` ops (1d with an empty padding, 2d),
``_weight_norm_interface`` (and ``_weight_norm``, which calls it),
``_cdist_backward``, ``_pdist_backward``): op_policy.py refuses them with their reason.

Example::

    >>> from torch_opaque.archive.admitted_ops import family_of
    >>> family_of("aten", "index_select").name, family_of("aten", "add_").name
    ('indexing', 'pointwise')
    >>> family_of("aten", "views_") is None, family_of("aten", "from_file") is None
    (True, True)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    why: str  # one line: why its kernels check their arguments
    ops: frozenset  # operator names in the aten namespace (or "prims::name")
    in_place: bool = False  # each name's in-place form ("add_") is admitted too


def _names(text: str) -> frozenset:
    return frozenset(text.split())


FAMILIES = (
    Family(
        "pointwise",
        "elementwise math: TensorIterator checks that the operands broadcast and their dtypes "
        "promote, and uses no value as an index",
        _names("""
        abs absolute acos acosh add addcdiv addcmul angle arccos arccosh arcsin arcsinh arctan
        arctan2 arctanh asin asinh atan atan2 atanh bitwise_and bitwise_left_shift bitwise_not
        bitwise_or bitwise_right_shift bitwise_xor ceil celu clamp clamp_max clamp_min clip
        conj_physical copysign cos cosh deg2rad digamma div divide elu eq erf erfc erfinv exp exp2
        expm1 fix float_power floor floor_divide fmax fmin fmod frac frexp gcd ge gelu glu greater
        greater_equal gt hardshrink hardsigmoid hardswish hardtanh heaviside hypot i0 igamma igammac
        isclose isfinite isinf isnan isneginf isposinf isreal lcm ldexp le leaky_relu lerp less
        less_equal lgamma log log10 log1p log2 log_sigmoid log_sigmoid_forward logaddexp logaddexp2
        logical_and logical_not logical_or logical_xor logit lt masked_fill maximum minimum mish mul
        multiply mvlgamma nan_to_num ne neg negative nextafter not_equal polygamma positive pow prelu
        rad2deg real imag reciprocal relu relu6 remainder round rrelu rsqrt rsub selu sgn sigmoid
        sign signbit silu sin sinc sinh softplus softshrink special_entr special_erfcx special_i0e
        special_i1 special_i1e special_log_ndtr special_ndtri special_xlog1py special_zeta sqrt
        square sub subtract tan tanh threshold true_divide trunc where xlogy conj resolve_conj
        resolve_neg _conj _conj_physical _neg_view _add_relu _prelu_kernel __and__ __or__ __xor__
        __lshift__ __rshift__ __iand__ __ior__ __ixor__ __ilshift__ __irshift__
        """),
        in_place=True,
    ),
    Family(
        "pointwise backward",
        "the gradients of pointwise ops: TensorIterator over operands it checks to broadcast",
        _names("""
        threshold_backward gelu_backward silu_backward sigmoid_backward tanh_backward
        hardtanh_backward leaky_relu_backward elu_backward softplus_backward hardsigmoid_backward
        hardswish_backward mish_backward logit_backward log_sigmoid_backward hardshrink_backward
        softshrink_backward native_dropout_backward glu_backward _prelu_kernel_backward
        """),
    ),
    Family(
        "creation",
        "new tensors: sizes are checked non-negative and the allocation's byte count for overflow",
        _names("""
        empty empty_like empty_strided zeros zeros_like ones ones_like full full_like new_empty
        new_empty_strided new_zeros new_ones new_full scalar_tensor arange linspace logspace eye
        tril_indices triu_indices fill zero lift_fresh_copy _efficientzerotensor _dim_arange
        """),
        in_place=True,
    ),
    Family(
        "copies and conversions",
        "a copy into a new tensor of the source's size (or a checked broadcast for copy)",
        _names("""
        clone copy contiguous _to_copy to type_as _lazy_clone alias_copy detach_copy view_copy
        _reshape_copy lift lift_fresh _conj_copy _neg_view_copy
        """),
        in_place=True,
    ),
    Family(
        "views",
        "views of an existing tensor: every size, stride and offset is checked to stay inside its "
        "storage (as_strided checks the storage bounds too)",
        _names("""
        view reshape _unsafe_view permute transpose t swapaxes swapdims movedim moveaxis expand
        expand_as expand_copy squeeze unsqueeze squeeze_copy unsqueeze_copy slice select narrow
        diagonal unfold alias detach as_strided flatten unflatten view_as split split_with_sizes
        tensor_split chunk unbind split_copy split_with_sizes_copy unbind_copy slice_copy
        select_copy permute_copy transpose_copy t_copy diagonal_copy as_strided_copy unfold_copy
        numpy_T mT mH adjoint view_as_real view_as_complex ravel atleast_1d
        atleast_2d atleast_3d hsplit vsplit dsplit
        """),
    ),
    Family(
        "shape queries and asserts",
        "read a tensor's metadata or check a condition; nothing is indexed",
        _names("""
        sym_size sym_numel sym_stride sym_storage_offset sym_is_contiguous size stride numel dim
        is_contiguous is_nonzero item _local_scalar_dense _assert_async _assert_scalar
        _assert_tensor_metadata _functional_assert_async _functional_assert_scalar
        sym_constrain_range sym_constrain_range_for_size _functional_sym_constrain_range
        _functional_sym_constrain_range_for_size _make_dep_token _shape_as_tensor is_same_size
        equal allclose _is_all_true _is_any_true
        """),
    ),
    Family(
        "reductions and scans",
        "the dims are wrapped and checked against the input's rank; outputs are sized by the kernel",
        _names("""
        sum mean amax amin max min argmax argmin aminmax _aminmax prod var std var_mean std_mean
        norm linalg_vector_norm logsumexp cumsum cumprod cummax cummin logcumsumexp _logcumsumexp
        any all count_nonzero nansum nanmean median nanmedian mode kthvalue frobenius_norm
          sum_to_size
        """),
    ),
    Family(
        "matrix products",
        "operand sizes are checked to agree before the BLAS call",
        _names("""
        mm bmm addmm _addmm_activation addbmm baddbmm addmv addr mv dot vdot matmul linear outer
        ger einsum tensordot kron inner chain_matmul cross linalg_cross _trilinear
        """),
    ),
    Family(
        "convolution",
        "weight, input, stride, padding and dilation are checked against each other "
        "(convolution's shape checks) before any kernel runs",
        _names("""
        convolution _convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d
        conv_transpose3d convolution_backward _convolution_double_backward
        """),
    ),
    Family(
        "pooling and resampling",
        "kernel sizes, strides and output sizes are checked against the input; indices are "
        "produced by the kernel, never read from an argument",
        _names("""
        avg_pool1d avg_pool2d avg_pool3d avg_pool2d_backward avg_pool3d_backward max_pool1d
        max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
        max_pool3d_with_indices adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
        _adaptive_avg_pool2d _adaptive_avg_pool3d _adaptive_avg_pool2d_backward
        _adaptive_avg_pool3d_backward adaptive_avg_pool3d_backward adaptive_max_pool1d
        adaptive_max_pool2d adaptive_max_pool3d upsample_nearest1d upsample_nearest2d
        upsample_nearest3d upsample_linear1d upsample_bilinear2d upsample_trilinear3d
        upsample_bicubic2d _upsample_nearest_exact1d _upsample_nearest_exact2d
        _upsample_nearest_exact3d _upsample_bilinear2d_aa _upsample_bicubic2d_aa
        upsample_nearest1d_backward upsample_nearest2d_backward upsample_nearest3d_backward
        upsample_linear1d_backward upsample_bilinear2d_backward upsample_trilinear3d_backward
        upsample_bicubic2d_backward _upsample_nearest_exact1d_backward
        _upsample_nearest_exact2d_backward _upsample_nearest_exact3d_backward
        _upsample_bilinear2d_aa_backward _upsample_bicubic2d_aa_backward grid_sampler
        grid_sampler_2d grid_sampler_3d grid_sampler_2d_backward grid_sampler_3d_backward
        _grid_sampler_2d_cpu_fallback _grid_sampler_2d_cpu_fallback_backward affine_grid_generator
        pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle im2col col2im
        """),
    ),
    Family(
        "normalization",
        "the weight, bias and statistics are checked to have one value per channel or the "
        "normalized shape (the batch-norm family's CPU kernels do not: the loader checks them, "
        "op_policy.check_batch_norm)",
        _names("""
        native_layer_norm layer_norm native_layer_norm_backward native_group_norm group_norm
        native_group_norm_backward native_batch_norm native_batch_norm_backward batch_norm
        _native_batch_norm_legit _native_batch_norm_legit_functional
        _native_batch_norm_legit_no_training _batch_norm_with_update
        _batch_norm_with_update_functional _batch_norm_no_update batch_norm_backward instance_norm
        rms_norm _fused_rms_norm _fused_rms_norm_backward  
         renorm
        """),
    ),
    Family(
        "softmax and attention",
        "the dim is checked against the rank, query/key/value sizes against each other",
        _names("""
        softmax log_softmax _softmax _log_softmax _softmax_backward_data _log_softmax_backward_data
        _safe_softmax special_softmax special_log_softmax scaled_dot_product_attention
        _scaled_dot_product_attention_math _scaled_dot_product_flash_attention_for_cpu
        _scaled_dot_product_flash_attention_for_cpu_backward _masked_softmax
        _scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention_backward
        _scaled_dot_product_flash_attention _scaled_dot_product_flash_attention_backward
        """),
    ),
    Family(
        "indexing",
        "every index read from a tensor or an argument is bounds-checked by the kernel "
        "(an out-of-range index raises IndexError or RuntimeError)",
        _names("""
        index index_select gather scatter scatter_add scatter_reduce index_put index_add
        index_copy index_fill index_reduce take take_along_dim masked_select masked_scatter
        nonzero nonzero_static argwhere embedding  
         select_scatter slice_scatter diagonal_scatter
        as_strided_scatter select_backward slice_backward diagonal_backward _unsafe_index
        _unsafe_index_put _unsafe_masked_index _unsafe_masked_index_put_accumulate one_hot
        gather_backward index_select_backward put
        """),
        in_place=True,
    ),
    Family(
        "joining, padding and reordering",
        "output sizes come from the inputs' checked sizes; pads, shifts and repeats are checked "
        "against them",
        _names("""
        cat concat concatenate stack hstack vstack dstack  _chunk_cat constant_pad_nd pad
        reflection_pad1d reflection_pad2d reflection_pad3d replication_pad1d replication_pad2d
        replication_pad3d  
         replication_pad1d_backward replication_pad2d_backward
        replication_pad3d_backward _pad_circular repeat repeat_interleave tile roll flip fliplr
        flipud rot90 tril triu diag diag_embed diagflat block_diag broadcast_to broadcast_tensors
        meshgrid cartesian_prod combinations trace unfold_backward
        """),
    ),
    Family(
        "sorting, searching and counting",
        "k, dims and the sorted sequence's size are checked; indices are produced by the kernel",
        _names("""
        sort argsort msort topk searchsorted bucketize unique_consecutive unique_dim _unique
        _unique2 histc bincount
        """),
    ),
    Family(
        "losses",
        "input and target sizes are checked to agree, class targets to lie within the classes",
        _names("""
        mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
        binary_cross_entropy_with_logits nll_loss nll_loss_forward nll_loss2d nll_loss2d_forward
        nll_loss_nd cross_entropy_loss kl_div soft_margin_loss margin_ranking_loss
        hinge_embedding_loss cosine_embedding_loss triplet_margin_loss poisson_nll_loss
        mse_loss_backward smooth_l1_loss_backward huber_loss_backward binary_cross_entropy_backward
        nll_loss_backward nll_loss2d_backward soft_margin_loss_backward cosine_similarity
        pairwise_distance cdist _cdist_forward  pdist _pdist_forward 
        _euclidean_dist dist
        """),
    ),
    Family(
        "random",
        "sizes and distribution parameters are checked; a loaded program has no generator of its "
        "own, so these draw from the default one",
        _names("""
        rand rand_like randn randn_like randint randint_like randperm bernoulli dropout
        native_dropout feature_dropout alpha_dropout feature_alpha_dropout multinomial normal
        normal_functional uniform exponential poisson _fused_dropout _masked_scale _standard_gamma
        _standard_gamma_grad _sample_dirichlet _dirichlet_grad random log_normal cauchy geometric
        """),
        in_place=True,
    ),
    Family(
        "linear algebra and FFT",
        "LAPACK and pocketfft calls whose matrix and transform sizes are checked first",
        _names("""
        _linalg_det _linalg_eigh _linalg_eigvals _linalg_slogdet _linalg_solve_ex _linalg_svd
        _linalg_check_errors _lu_with_info linalg_det linalg_slogdet linalg_inv linalg_inv_ex
        linalg_solve linalg_solve_ex linalg_cholesky linalg_cholesky_ex linalg_qr linalg_svd
        linalg_svdvals linalg_eigh linalg_eigvalsh linalg_eig linalg_eigvals linalg_norm
        linalg_matrix_norm linalg_pinv linalg_lstsq linalg_lu linalg_lu_factor linalg_lu_factor_ex
        linalg_lu_solve linalg_solve_triangular linalg_matrix_power linalg_matrix_rank
        linalg_matrix_exp linalg_multi_dot linalg_vecdot logdet det slogdet inverse cholesky
        cholesky_solve cholesky_inverse triangular_solve qr svd pinverse matrix_power matrix_exp
           fft_fft fft_ifft fft_rfft fft_irfft fft_fft2 fft_ifft2
        fft_rfft2 fft_irfft2 fft_fftn fft_ifftn fft_rfftn fft_irfftn fft_hfft fft_ihfft
        fft_fftshift fft_ifftshift fft_fftfreq fft_rfftfreq stft istft
        """),
    ),
    Family(
        "recurrent layers",
        "the weights' sizes are checked against the hidden and input sizes before the cells run",
        _names("""
        lstm gru rnn_tanh rnn_relu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
        _thnn_fused_lstm_cell _thnn_fused_gru_cell
        """),
    ),
    Family(
        "foreach",
        "the lists are checked to have the same length and each pair of tensors to broadcast",
        _names("""
        _foreach_add _foreach_sub _foreach_mul _foreach_div _foreach_neg _foreach_sqrt
        _foreach_exp _foreach_abs _foreach_addcmul _foreach_addcdiv _foreach_norm 
        _foreach_clone _foreach_pow _foreach_lerp _foreach_maximum _foreach_minimum _foreach_sign
        _foreach_zero
        """),
    ),
    Family(
        "effect tokens",
        "prims that thread torch.export's effect tokens; they compute nothing",
        _names("prims::_make_token prims::_sink_tokens"),
    ),
)


def family_table_markdown() -> str:
    """The list of admitted families docs/shipping.md shows (a test compares it)."""
    rows = ["| family | why its kernels are safe with arguments from a file | operators |", "|---|---|---|"]
    for f in FAMILIES:
        rows.append(f"| {f.name} | {f.why} | {len(f.ops)}{' (and in-place forms)' if f.in_place else ''} |")
    return "\n".join(rows)


_BY_NAME = {op: f for f in FAMILIES for op in f.ops}


def family_of(ns: str, name: str):
    """The Family admitting operator `ns::name` (any overload), or None."""
    key = name if ns == "aten" else f"{ns}::{name}"
    f = _BY_NAME.get(key)
    if f is None and name.endswith("_") and not name.endswith("__"):
        f = _BY_NAME.get(key[:-1])
        f = f if f is not None and f.in_place else None
    return f
