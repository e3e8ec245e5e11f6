#pragma once
// Note [Records of replayed forwards]
// A Python dispatch mode may answer a `_fwd` call without running its
// kernel: selective activation checkpointing with a MUST_SAVE / PREFER_SAVE
// policy caches `_fwd`'s outputs during the forward and, when checkpoint
// recomputes the region for the backward, returns detached aliases of them
// instead of calling the kernel. The kernel then reports no forward record,
// and the Autograd kernel could not build the backward node. So while a
// dispatch mode is active, the Autograd kernel keeps the record of each call
// on real tensors, keyed by the storage of its first output (weakly); a call
// answered without a record takes the record of the call whose outputs it
// was given (the same storage, alive). The record holds indices and the ctx
// state (Note [Eager context state]): records whose storage died are dropped
// when the table has doubled since the last purge (at least 64 entries), so
// under such a mode ctx attributes may outlive their outputs by that many
// calls.

#include <torch_opaque/forward_record.h>

#include <ATen/core/Tensor.h>

#include <optional>

namespace torch_opaque::detail {

// Whether records of calls now are kept (a dispatch mode is active and
// `first_output` is a plain tensor with storage).
bool keeps_records(const at::Tensor& first_output);

// Keeps `record` for the storage of `first_output`.
void remember_record(const at::Tensor& first_output, const ForwardRecord& record);

// The record kept for the storage of `first_output`, if it is alive.
std::optional<ForwardRecord> replayed_record(const at::Tensor& first_output);

} // namespace torch_opaque::detail
