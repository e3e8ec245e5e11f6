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
#include <tuple>
#include <type_traits>
#include <vector>

namespace torch_opaque::detail {

template <class T>
using bare_t = std::remove_cv_t<std::remove_reference_t<T>>;

template <class T>
struct always_false : std::false_type {};

template <class T, class Enable = void>
struct ArgType {
  static_assert(always_false<T>::value,
                "torch_opaque: unsupported forward argument type. Use at::Tensor, "
                "std::optional<at::Tensor>, std::vector<at::Tensor>, int64_t, c10::SymInt, "
                "double, bool, std::string, at::ScalarType, std::vector<int64_t>, "
                "std::vector<c10::SymInt>, std::vector<double> or std::vector<bool> "
                "(const references allowed).");
};

#define TORCH_OPAQUE_ARG(CPP, SCHEMA, IS_TENSOR, EXPR)            \
  template <>                                                       \
  struct ArgType<CPP> {                                             \
    using storage = CPP;                                            \
    static constexpr const char* schema = SCHEMA;                   \
    static constexpr bool is_tensor = IS_TENSOR;                    \
    static storage from(const c10::IValue& v) { return EXPR; }      \
  };

TORCH_OPAQUE_ARG(at::Tensor, "Tensor", true, v.toTensor())
TORCH_OPAQUE_ARG(std::optional<at::Tensor>, "Tensor?", true,
                 v.isNone() ? std::optional<at::Tensor>() : std::optional<at::Tensor>(v.toTensor()))
TORCH_OPAQUE_ARG(std::vector<at::Tensor>, "Tensor[]", false, v.toTensorVector())
TORCH_OPAQUE_ARG(int64_t, "int", false, v.toInt())
TORCH_OPAQUE_ARG(c10::SymInt, "SymInt", false, v.toSymInt())
TORCH_OPAQUE_ARG(double, "float", false, v.toDouble())
TORCH_OPAQUE_ARG(bool, "bool", false, v.toBool())
TORCH_OPAQUE_ARG(std::string, "str", false, v.toStringRef())
TORCH_OPAQUE_ARG(at::ScalarType, "ScalarType", false, v.toScalarType())
TORCH_OPAQUE_ARG(std::vector<int64_t>, "int[]", false, v.toIntVector())
TORCH_OPAQUE_ARG(std::vector<c10::SymInt>, "SymInt[]", false, v.toSymIntVector())
TORCH_OPAQUE_ARG(std::vector<double>, "float[]", false, v.toDoubleVector())
TORCH_OPAQUE_ARG(std::vector<bool>, "bool[]", false,
                 std::vector<bool>(v.toBoolList().begin(), v.toBoolList().end()))
#undef TORCH_OPAQUE_ARG

// Returns: one Tensor, or a std::tuple of Tensors.
template <class R>
struct ReturnType {
  static_assert(always_false<R>::value,
                "torch_opaque: forward must return at::Tensor or std::tuple<at::Tensor, ...>.");
};
template <>
struct ReturnType<at::Tensor> {
  static constexpr size_t count = 1;
  static std::vector<at::Tensor> flatten(at::Tensor t) { return {std::move(t)}; }
};
template <class... Ts>
struct ReturnType<std::tuple<Ts...>> {
  static_assert((std::is_same_v<Ts, at::Tensor> && ...),
                "torch_opaque: every element of the returned std::tuple must be at::Tensor.");
  static constexpr size_t count = sizeof...(Ts);
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
