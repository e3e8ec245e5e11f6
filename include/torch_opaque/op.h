#pragma once
// One definition, one differentiable, exportable operator written in C++.
//
//   struct ScaledSin {
//     static at::Tensor forward(torch_opaque::Context& ctx, const at::Tensor& x,
//                               double scale) {
//       ctx.save_for_backward({x});
//       ctx.saved_data["scale"] = scale;
//       return at::sin(x) * scale;
//     }
//     static std::vector<at::Tensor> backward(torch_opaque::Context& ctx,
//                                             std::vector<at::Tensor> grads) {
//       const at::Tensor& x = ctx.saved_tensors()[0];
//       double scale = ctx.saved_data["scale"].toDouble();
//       return {grads[0] * at::cos(x) * scale, at::Tensor()};
//     }
//   };
//   TORCH_OPAQUE_DEF(ScaledSin, "myops::scaled_sin", "x", "scale")
//
// registers myops::scaled_sin(Tensor x, float scale) -> Tensor, with its
// `_fwd`/`_bwd` companions, the Autograd kernel, CompositeExplicitAutograd
// kernels (which also serve Meta, so the op runs on meta and fake tensors when
// forward is made of ATen ops) and, if Op has a `fake` with forward's
// signature, a Meta kernel from it. Optional members: `jvp` (forward-mode AD,
// Note [C++ jvp] in detail/jvp_finisher.h) and `batched_forward` (forward's
// signature, run once per batch under vmap; without it the op runs once per
// sample, Note [Per-sample batching] in csrc/per_sample_batching.cpp).
// It also defines the op's autocast variant `myops::scaled_sin_autocast(...,
// str autocast_state)`, which traced programs call to keep torch.autocast
// (Note [Autocast in the call: C++ ops] in csrc/autocast_variant.cpp).

#include <torch_opaque/context.h>
#include <torch_opaque/detail/arg_types.h>
#include <torch_opaque/detail/autocast_variant.h>
#include <torch_opaque/detail/finishers.h>
#include <torch_opaque/detail/jvp_finisher.h>
#include <torch_opaque/gradient.h>
#include <torch_opaque/opaque_op.h>

// An op body needs ATen's functions (at::sin, at::matmul, ...): bring them.
#include <ATen/ATen.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <sstream>
#include <string>
#include <iterator>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch_opaque {

namespace detail {

template <class Op, class = void>
struct has_fake : std::false_type {};
template <class Op>
struct has_fake<Op, std::void_t<decltype(&Op::fake)>> : std::true_type {};

template <class Op, class = void>
struct has_output_names : std::false_type {};
template <class Op>
struct has_output_names<Op, std::void_t<decltype(std::size(Op::output_names))>>
    : std::true_type {};

// Whether Op has a member named `forward` at all (also when it is overloaded,
// where &Op::forward is ambiguous): a base with its own `forward` makes the
// name ambiguous in Both exactly when Op has one.
struct ForwardNameProbe {
  int forward;
};
template <class Op>
struct ForwardNameBoth : Op, ForwardNameProbe {};
template <class Op, class = void>
struct names_forward : std::true_type {};
template <class Op>
struct names_forward<Op, std::void_t<decltype(&ForwardNameBoth<Op>::forward)>>
    : std::false_type {};

template <class Op, class = void>
struct has_forward : std::false_type {};
template <class Op>
struct has_forward<Op, std::void_t<decltype(&Op::forward)>> : std::true_type {};

template <class R>
struct is_backward_result
    : std::bool_constant<std::is_convertible_v<R, std::vector<at::Tensor>> ||
                         std::is_convertible_v<R, std::vector<Gradient>>> {};

template <class Op, class = void>
struct has_backward : std::false_type {};
template <class Op>
struct has_backward<Op, std::void_t<decltype(Op::backward(std::declval<Context&>(),
                                                           std::declval<std::vector<at::Tensor>>()))>>
    : is_backward_result<decltype(Op::backward(std::declval<Context&>(),
                                               std::declval<std::vector<at::Tensor>>()))> {};

// Optional forward for a whole batch (Note [Per-sample batching]).
template <class Op, class = void>
struct has_batched_forward : std::false_type {};
template <class Op>
struct has_batched_forward<Op, std::void_t<decltype(&Op::batched_forward)>> : std::true_type {};

// Optional forward-mode derivative (Note [C++ jvp] in detail/jvp_finisher.h).
template <class Op, class = void>
struct has_jvp : std::false_type {};
template <class Op>
struct has_jvp<Op, std::void_t<decltype(&Op::jvp)>> : std::true_type {};

template <class Op, class = void>
struct jvp_callable : std::false_type {};
template <class Op>
struct jvp_callable<Op, std::void_t<decltype(Op::jvp(std::declval<Context&>(),
                                                     std::declval<std::vector<at::Tensor>>()))>>
    : std::is_convertible<decltype(Op::jvp(std::declval<Context&>(),
                                           std::declval<std::vector<at::Tensor>>())),
                          std::vector<at::Tensor>> {};

// A backward's result as one Gradient per forward argument.
inline std::vector<Gradient> to_gradients(std::vector<Gradient> g) { return g; }
inline std::vector<Gradient> to_gradients(std::vector<at::Tensor> g) {
  return std::vector<Gradient>(std::make_move_iterator(g.begin()),
                               std::make_move_iterator(g.end()));
}

template <class Args, size_t I>
using arg_type_t = typename ForwardArgument<I, std::tuple_element_t<I, Args>>::type;

// The unboxed arguments, in owning storage (see ArgType).
template <class Args, size_t... I>
std::tuple<typename arg_type_t<Args, I>::storage...> unbox(c10::ArrayRef<c10::IValue> in,
                                                           std::index_sequence<I...>) {
  return {arg_type_t<Args, I>::from(in[I])...};
}

template <class Args, size_t... I>
std::string schema_arguments(const std::vector<std::string>& names, std::index_sequence<I...>) {
  std::ostringstream ss;
  ((ss << (I ? ", " : "") << arg_type_t<Args, I>::schema() << " " << names[I]), ...);
  return ss.str();
}

template <class Args, size_t... I>
std::vector<bool> tensor_arguments(std::index_sequence<I...>) {
  return {arg_type_t<Args, I>::is_tensor...};
}

template <class Args, size_t... I>
std::vector<bool> tensor_list_arguments(std::index_sequence<I...>) {
  return {arg_type_t<Args, I>::is_tensor_list...};
}

template <class Args, size_t... I>
constexpr bool any_tensor_list(std::index_sequence<I...>) {
  return (false || ... || arg_type_t<Args, I>::is_tensor_list);
}

// A forward-like function (forward or fake) as a BoxedKernel of `_fwd`.
template <class Fn>
BoxedKernel forward_kernel(Fn fn, std::string op_name) {
  using Sig = ForwardSignature<Fn>;
  using Args = typename Sig::args;
  return [fn, op_name](const c10::FunctionSchema&, torch::jit::Stack* stack) {
    c10::SmallVector<c10::IValue, 8> inputs(std::make_move_iterator(stack->end() - Sig::arity),
                                            std::make_move_iterator(stack->end()));
    torch::jit::drop(*stack, Sig::arity);
    std::optional<std::vector<bool>> needs = take_needs_input_grad();
    const bool recording = needs.has_value();
    Context ctx(recording ? std::move(*needs) : std::vector<bool>(Sig::arity, false));
    auto args = unbox<Args>(inputs, std::make_index_sequence<Sig::arity>{});
    auto result = std::apply([&](auto&... a) { return fn(ctx, a...); }, args);
    if constexpr (any_tensor_list<Args>(std::make_index_sequence<Sig::arity>{})) {
      if (recording) record_list_sizes(ctx, inputs);
    }
    using Ret = ReturnType<typename Sig::result>;
    finish_forward(op_name, ctx, inputs, Ret::flatten(std::move(result)), recording, stack,
                   Ret::is_list);
  };
}

// Op::backward as `_bwd`'s kernel (Note [Direct backward] in opaque_op.h).
template <class Op, bool HasLists>
DirectBackward backward_kernel(std::string op_name, std::vector<bool> tensor_args,
                               std::vector<bool> list_args) {
  return [op_name, tensor_args, list_args](BackwardArgs args,
                                          const EagerState* eager) -> std::vector<at::Tensor> {
    Context ctx = backward_context(args, eager);
    std::vector<int64_t> list_sizes;
    if constexpr (HasLists) list_sizes = take_list_sizes(ctx);
    c10::SmallVector<at::Tensor, 4> grad_outputs(args.grads.begin(), args.grads.end());
    auto result = Op::backward(ctx, std::move(args.grads));
    if constexpr (!HasLists && std::is_convertible_v<decltype(result), std::vector<at::Tensor>>) {
      // One gradient per argument already: nothing to flatten.
      return finish_backward(op_name, tensor_args, std::vector<at::Tensor>(std::move(result)),
                             ctx.saved_tensors(), grad_outputs);
    } else {
      std::vector<bool> slots = tensor_args;
      std::vector<at::Tensor> flat = flatten_gradients(
          op_name, list_args, list_sizes, to_gradients(std::move(result)), &slots);
      return finish_backward(op_name, slots, std::move(flat), ctx.saved_tensors(),
                             grad_outputs);
    }
  };
}

// `_jvp`'s kernel: forward (without grad) and jvp on one Context.
template <class Op>
BoxedKernel jvp_kernel(std::string op_name) {
  using Sig = ForwardSignature<decltype(&Op::forward)>;
  using Args = typename Sig::args;
  return [op_name](const c10::FunctionSchema&, torch::jit::Stack* stack) {
    std::vector<at::Tensor> tangents = pop_jvp_tangents(stack);
    TORCH_CHECK(tangents.size() == Sig::arity, "torch_opaque: ", op_name, "_jvp got ",
                tangents.size(), " tangents for ", Sig::arity,
                " arguments. Pass one tangent (or None) per argument.");
    c10::SmallVector<c10::IValue, 8> inputs(std::make_move_iterator(stack->end() - Sig::arity),
                                            std::make_move_iterator(stack->end()));
    torch::jit::drop(*stack, Sig::arity);
    Context ctx(std::vector<bool>(Sig::arity, false));
    at::AutoGradMode no_grad(false);  // as a Python Function's forward and jvp run
    auto args = unbox<Args>(inputs, std::make_index_sequence<Sig::arity>{});
    auto result = std::apply([&](auto&... a) { return Op::forward(ctx, a...); }, args);
    using Ret = ReturnType<typename Sig::result>;
    std::vector<at::Tensor> outputs = Ret::flatten(std::move(result));
    ctx.set_saved_tensors(ctx.take_saved_for_forward());
    std::vector<at::Tensor> out_tangents = Op::jvp(ctx, tangents);
    finish_jvp(op_name, inputs, tangents, std::move(outputs), std::move(out_tangents), stack);
  };
}

} // namespace detail

// Defines the op `qualified_name` ("ns::name" or "ns::name.overload") from
// Op's static forward/backward (and optional fake, jvp and batched_forward). `arg_names` names the
// forward arguments after ctx; without names they are arg0, arg1, ...
template <class Op>
std::shared_ptr<OpaqueOp> def(const std::string& qualified_name,
                              std::vector<std::string> arg_names = {}) {
  static_assert(detail::has_forward<Op>::value || detail::names_forward<Op>::value,
                "torch_opaque::def<Op>: Op needs `static R forward(torch_opaque::Context& "
                "ctx, Args... args)`.");
  static_assert(detail::has_forward<Op>::value || !detail::names_forward<Op>::value,
                "torch_opaque::def<Op>: Op::forward is overloaded (or a template); an op has "
                "one schema, so keep exactly one static forward and give the others other "
                "names (or define one op per overload).");
  static_assert(detail::has_backward<Op>::value,
                "torch_opaque::def<Op>: Op needs `static std::vector<at::Tensor> "
                "backward(torch_opaque::Context& ctx, std::vector<at::Tensor> grads)` (or "
                "returning std::vector<torch_opaque::Gradient>, when a Tensor[] argument "
                "gets one gradient per element).");
  using Sig = detail::ForwardSignature<decltype(&Op::forward)>;
  using Args = typename Sig::args;
  constexpr size_t n = Sig::arity;
  if constexpr (detail::has_fake<Op>::value) {
    static_assert(std::is_same_v<decltype(&Op::fake), decltype(&Op::forward)>,
                  "torch_opaque::def<Op>: Op::fake must have exactly forward's signature.");
  }
  if (arg_names.empty()) {
    for (size_t i = 0; i < n; ++i) arg_names.push_back("arg" + std::to_string(i));
  }
  TORCH_CHECK(arg_names.size() == n, "torch_opaque::def<Op>(\"", qualified_name, "\"): ",
              arg_names.size(), " argument names given, but forward takes ", n,
              " arguments after ctx. Name each of them, in order.");
  const auto sep = qualified_name.find("::");
  TORCH_CHECK(sep != std::string::npos && sep > 0, "torch_opaque::def<Op>(\"", qualified_name,
              "\"): the name must be qualified, as in \"myops::my_op\".");
  OpDefinition d;
  d.ns = qualified_name.substr(0, sep);
  std::string rest = qualified_name.substr(sep + 2);
  const auto dot = rest.find('.');
  d.name = rest.substr(0, dot);
  d.overload = dot == std::string::npos ? "" : rest.substr(dot + 1);
  d.arguments = detail::schema_arguments<Args>(arg_names, std::make_index_sequence<n>{});
  using Ret = detail::ReturnType<typename Sig::result>;
  constexpr size_t n_out = Ret::count;
  d.returns.assign(n_out, Ret::is_list ? "Tensor[]" : "Tensor");
  if constexpr (detail::has_output_names<Op>::value) {
    static_assert(std::size(Op::output_names) == n_out,
                  "torch_opaque::def<Op>: Op::output_names must name each output of forward, "
                  "in order.");
    for (size_t k = 0; k < n_out; ++k) d.returns[k] += std::string(" ") + Op::output_names[k];
  }
  d.forward = detail::forward_kernel(&Op::forward, qualified_name);
  d.direct_backward = detail::backward_kernel<
      Op, detail::any_tensor_list<Args>(std::make_index_sequence<n>{})>(
      qualified_name, detail::tensor_arguments<Args>(std::make_index_sequence<n>{}),
      detail::tensor_list_arguments<Args>(std::make_index_sequence<n>{}));
  if constexpr (detail::has_fake<Op>::value) {
    d.meta_forward = detail::forward_kernel(&Op::fake, qualified_name);
  }
  if constexpr (detail::has_jvp<Op>::value) {
    static_assert(detail::jvp_callable<Op>::value,
                  "torch_opaque::def<Op>: Op::jvp must be `static std::vector<at::Tensor> "
                  "jvp(torch_opaque::Context& ctx, std::vector<at::Tensor> tangents)`: one "
                  "tangent per forward argument in, one per output out.");
    static_assert(!Ret::is_list && !detail::any_tensor_list<Args>(std::make_index_sequence<n>{}),
                  "torch_opaque::def<Op>: Op::jvp is not supported for ops with Tensor[] "
                  "arguments or a Tensor[] result yet; remove jvp (forward-mode AD then "
                  "raises torch's error) or take/return separate tensors.");
    d.jvp = detail::jvp_kernel<Op>(qualified_name);
  }
  if constexpr (detail::has_batched_forward<Op>::value) {
    static_assert(std::is_same_v<decltype(&Op::batched_forward), decltype(&Op::forward)>,
                  "torch_opaque::def<Op>: Op::batched_forward must have exactly forward's "
                  "signature (every tensor argument and output then has the batch as its "
                  "first dimension).");
    d.batched_forward = detail::forward_kernel(&Op::batched_forward, qualified_name);
  }
  d.differentiate_lists = true;
  d.per_sample_batching = true;
  std::shared_ptr<OpaqueOp> op = define_op(std::move(d));
  detail::define_autocast_variant(op);  // Note [Autocast in the call: C++ ops]
  return op;
}

namespace detail {

template <class... Names>
constexpr std::integral_constant<size_t, sizeof...(Names)> count_names(const Names&...) {
  return {};
}

// What TORCH_OPAQUE_DEF leaves at namespace scope: registers at load time and
// records a failure instead of throwing (Note [Static registration errors]).
template <class Op, size_t NumNames>
struct StaticDefinition {
  template <class O, class = void>
  struct arity : std::integral_constant<size_t, NumNames> {};  // reported by def<Op>
  template <class O>
  struct arity<O, std::void_t<decltype(&O::forward)>>
      : std::integral_constant<size_t, ForwardSignature<decltype(&O::forward)>::arity> {};
  static_assert(NumNames == 0 || NumNames == arity<Op>::value,
                "TORCH_OPAQUE_DEF(Op, \"ns::name\", names...): give one name per forward "
                "argument after ctx, in order (or none, for arg0, arg1, ...).");
  StaticDefinition(const char* qualified_name, std::vector<std::string> arg_names) {
    try {
      op = def<Op>(qualified_name, std::move(arg_names));
    } catch (const c10::Error& e) {
      record_registration_error(e.what_without_backtrace());
    } catch (const std::exception& e) {
      record_registration_error(e.what());
    }
  }
  std::shared_ptr<OpaqueOp> op; // null when the registration failed
};

} // namespace detail

} // namespace torch_opaque

#define TORCH_OPAQUE_CONCAT_INNER(a, b) a##b
#define TORCH_OPAQUE_CONCAT(a, b) TORCH_OPAQUE_CONCAT_INNER(a, b)

// At namespace scope: TORCH_OPAQUE_DEF(Op, "ns::name", "arg", "names", ...)
// A failed registration does not throw (it would end the process while the
// library loads): see Note [Static registration errors].
#define TORCH_OPAQUE_DEF(OP, QUALIFIED_NAME, ...)                                     \
  static const ::torch_opaque::detail::StaticDefinition<                             \
      OP, decltype(::torch_opaque::detail::count_names(__VA_ARGS__))::value>         \
      TORCH_OPAQUE_CONCAT(torch_opaque_registration_, __COUNTER__)(QUALIFIED_NAME, \
                                                                   {__VA_ARGS__})
