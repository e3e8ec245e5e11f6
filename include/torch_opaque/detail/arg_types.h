#pragma once
// How a C++ forward argument type maps to a schema type, and how a stack value
// becomes that argument. One specialization per supported type; anything else
// fails to compile with a message naming the supported types.

#include <torch_opaque/context.h>

#include <ATen/core/ivalue.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/SymInt.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

namespace torch_opaque::detail {

template <class T>
using bare_t = std::remove_cv_t<std::remove_reference_t<T>>;

template <class T>
struct always_false : std::false_type {};

// ArgType<T>: `schema()` (the schema type), `is_tensor` (a differentiable
// tensor argument), `storage` (what holds the unboxed value while forward runs:
// an owning type, so view types such as at::IntArrayRef or std::string_view
// point into it) and `from(IValue)`.
template <class T, class Enable = void>
struct ArgType {
  static constexpr bool supported = false;
};

template <class T>
struct is_supported_arg : std::bool_constant<ArgType<T>::supported> {};

#define TORCH_OPAQUE_ARG(CPP, STORAGE, SCHEMA, IS_TENSOR, EXPR)     \
  template <>                                                       \
  struct ArgType<CPP> {                                             \
    static constexpr bool supported = true;                         \
    using storage = STORAGE;                                        \
    static std::string schema() { return SCHEMA; }                  \
    static constexpr bool is_tensor = IS_TENSOR;                    \
    static constexpr bool is_tensor_list =                          \
        std::is_same_v<STORAGE, std::vector<at::Tensor>>;           \
    static storage from(const c10::IValue& v) { return EXPR; }      \
  };

TORCH_OPAQUE_ARG(at::Tensor, at::Tensor, "Tensor", true, v.toTensor())
TORCH_OPAQUE_ARG(std::optional<at::Tensor>, std::optional<at::Tensor>, "Tensor?", true,
                 v.isNone() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(v.toTensor()))
// Tensor lists: each element is differentiable (see Gradient).
TORCH_OPAQUE_ARG(std::vector<at::Tensor>, std::vector<at::Tensor>, "Tensor[]", false,
                 v.toTensorVector())
TORCH_OPAQUE_ARG(at::TensorList, std::vector<at::Tensor>, "Tensor[]", false, v.toTensorVector())
TORCH_OPAQUE_ARG(int64_t, int64_t, "int", false, v.toInt())
TORCH_OPAQUE_ARG(c10::SymInt, c10::SymInt, "SymInt", false, v.toSymInt())
TORCH_OPAQUE_ARG(double, double, "float", false, v.toDouble())
TORCH_OPAQUE_ARG(bool, bool, "bool", false, v.toBool())
TORCH_OPAQUE_ARG(std::string, std::string, "str", false, v.toStringRef())
TORCH_OPAQUE_ARG(std::string_view, std::string, "str", false, v.toStringRef())
TORCH_OPAQUE_ARG(at::Scalar, at::Scalar, "Scalar", false, v.toScalar())
TORCH_OPAQUE_ARG(at::ScalarType, at::ScalarType, "ScalarType", false, v.toScalarType())
TORCH_OPAQUE_ARG(c10::Device, c10::Device, "Device", false, v.toDevice())
TORCH_OPAQUE_ARG(at::Layout, at::Layout, "Layout", false, v.toLayout())
TORCH_OPAQUE_ARG(std::vector<int64_t>, std::vector<int64_t>, "int[]", false, v.toIntVector())
TORCH_OPAQUE_ARG(at::IntArrayRef, std::vector<int64_t>, "int[]", false, v.toIntVector())
TORCH_OPAQUE_ARG(std::vector<c10::SymInt>, std::vector<c10::SymInt>, "SymInt[]", false,
                 v.toSymIntVector())
TORCH_OPAQUE_ARG(c10::SymIntArrayRef, std::vector<c10::SymInt>, "SymInt[]", false,
                 v.toSymIntVector())
TORCH_OPAQUE_ARG(std::vector<double>, std::vector<double>, "float[]", false, v.toDoubleVector())
TORCH_OPAQUE_ARG(c10::ArrayRef<double>, std::vector<double>, "float[]", false,
                 v.toDoubleVector())
TORCH_OPAQUE_ARG(std::vector<bool>, std::vector<bool>, "bool[]", false,
                 std::vector<bool>(v.toBoolList().begin(), v.toBoolList().end()))
#undef TORCH_OPAQUE_ARG

// std::optional<T> of any supported non-tensor T: "T?" (None -> std::nullopt).
template <class T>
struct ArgType<std::optional<T>,
               std::enable_if_t<ArgType<T>::supported && !ArgType<T>::is_tensor>> {
  static constexpr bool supported = true;
  using storage = std::optional<typename ArgType<T>::storage>;
  static std::string schema() { return ArgType<T>::schema() + "?"; }
  static constexpr bool is_tensor = false;
  static constexpr bool is_tensor_list = false;
  static storage from(const c10::IValue& v) {
    return v.isNone() ? storage() : storage(ArgType<T>::from(v));
  }
};

// Instantiated once per forward argument: when a type is not supported, the
// compiler's "in instantiation of ForwardArgument<I, T>" line names the
// argument's position (after ctx, from 0) and its type.
template <size_t I, class T>
struct ForwardArgument {
  static_assert(is_supported_arg<T>::value,
                "torch_opaque: unsupported forward argument type (its position and type are "
                "in the `ForwardArgument<position, type>` line above). Use at::Tensor, "
                "std::optional<at::Tensor>, std::vector<at::Tensor> / at::TensorList, int64_t, "
                "c10::SymInt, double, bool, std::string / std::string_view, at::Scalar, "
                "at::ScalarType, c10::Device, at::Layout, std::vector<int64_t> / "
                "at::IntArrayRef, std::vector<c10::SymInt> / c10::SymIntArrayRef, "
                "std::vector<double>, std::vector<bool>, or std::optional of a non-tensor one "
                "(const references allowed).");
  using type = ArgType<T>;
};

// Returns: one Tensor, a std::tuple of Tensors, or a std::vector of Tensors
// (schema `Tensor[]`, each element a differentiable output; the backward gets
// one gradient per element).
template <class R>
struct ReturnType {
  static_assert(always_false<R>::value,
                "torch_opaque: forward must return at::Tensor, std::tuple<at::Tensor, ...> or "
                "std::vector<at::Tensor>.");
};
template <>
struct ReturnType<at::Tensor> {
  static constexpr size_t count = 1;
  static constexpr bool is_list = false;
  static std::vector<at::Tensor> flatten(at::Tensor t) { return {std::move(t)}; }
};
template <>
struct ReturnType<std::vector<at::Tensor>> {
  static constexpr size_t count = 1;
  static constexpr bool is_list = true;
  static std::vector<at::Tensor> flatten(std::vector<at::Tensor> t) { return t; }
};
template <class... Ts>
struct ReturnType<std::tuple<Ts...>> {
  static_assert((std::is_same_v<Ts, at::Tensor> && ...),
                "torch_opaque: every element of the returned std::tuple must be at::Tensor.");
  static constexpr size_t count = sizeof...(Ts);
  static constexpr bool is_list = false;
  static std::vector<at::Tensor> flatten(std::tuple<Ts...> t) {
    return std::apply([](auto&... x) { return std::vector<at::Tensor>{x...}; }, t);
  }
};

// forward / fake signatures: R(Context&, Args...)
template <class F>
struct ForwardSignature {
  static_assert(always_false<F>::value,
                "torch_opaque: forward must be `static R forward(torch_opaque::Context& ctx, "
                "Args... args)`.");
};
template <class Ctx, class R, class... Args>
struct ForwardSignature<R (*)(Ctx, Args...)> {
  static_assert(std::is_same_v<Ctx, ::torch_opaque::Context&>,
                "torch_opaque: the first parameter of forward (and fake) must be "
                "`torch_opaque::Context& ctx`.");
  using result = R;
  using args = std::tuple<bare_t<Args>...>;
  static constexpr size_t arity = sizeof...(Args);
};

} // namespace torch_opaque::detail
