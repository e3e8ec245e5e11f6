// GoogleTest suite for the dispatch key state of a torch.func level's user code
// (level_user_code_tls, Note [Nested grad] in csrc/nested_grad.cpp).
#include "nested_grad.h"

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <gtest/gtest.h>

namespace {

using K = c10::DispatchKey;
using torch_opaque::detail::level_user_code_tls;

TEST(LevelUserCodeTls, NoneOutsideTransforms) {
  EXPECT_FALSE(level_user_code_tls().has_value());
}

TEST(LevelUserCodeTls, NoneInUserCodeOfALevel) {
  // Transforms active (functorch's entry and exit keys included), no level
  // being processed.
  c10::impl::IncludeDispatchKeyGuard keys(
      c10::DispatchKeySet({K::FuncTorchDynamicLayerFrontMode, K::FuncTorchDynamicLayerBackMode}));
  EXPECT_FALSE(level_user_code_tls().has_value());
}

TEST(LevelUserCodeTls, UndoesALevelsProcessingState) {
  c10::impl::IncludeDispatchKeyGuard keys(c10::DispatchKeySet(
      {K::FuncTorchDynamicLayerFrontMode, K::FuncTorchDynamicLayerBackMode}));
  // What the user had excluded outside functorch's keys stays excluded.
  c10::impl::ExcludeDispatchKeyGuard user(K::AutocastCPU);
  // A vmap level's processing state: its entry key and the keys it does not
  // handle excluded, its randomness key included.
  c10::impl::ExcludeDispatchKeyGuard processing(c10::DispatchKeySet(
      {K::FuncTorchDynamicLayerFrontMode, K::FuncTorchGradWrapper, K::AutogradCPU,
       K::ADInplaceOrView, K::Functionalize}));
  c10::impl::IncludeDispatchKeyGuard randomness(K::FuncTorchVmapMode);
  std::optional<c10::impl::LocalDispatchKeySet> tls = level_user_code_tls();
  ASSERT_TRUE(tls.has_value());
  for (K k : {K::FuncTorchDynamicLayerFrontMode, K::FuncTorchGradWrapper, K::AutogradCPU,
              K::ADInplaceOrView, K::Functionalize}) {
    EXPECT_FALSE(tls->excluded_.has(k)) << k;
  }
  EXPECT_TRUE(tls->excluded_.has(K::AutocastCPU));
  EXPECT_FALSE(tls->included_.has(K::FuncTorchVmapMode));
  EXPECT_TRUE(tls->included_.has(K::FuncTorchDynamicLayerFrontMode));
  EXPECT_TRUE(tls->included_.has(K::FuncTorchDynamicLayerBackMode));
}

} // namespace
