#pragma once
// A C++ op's ctx.saved_data as the `_bwd` op's `state` argument (a string, plus
// the SymInts it refers to), and back. Compiled once in csrc/saved_data_codec.cpp.

#include <ATen/core/ivalue.h>
#include <c10/core/SymInt.h>

#include <map>
#include <string>
#include <vector>

namespace torch_opaque::detail {

// Note [saved_data encoding]
// "name=<tag>:<value>;" per entry, names sorted, with tags i (int), f (double,
// shortest round-trip text, std::to_chars), b (bool), s (string, %-escaped),
// n (None), y (SymInt: index into state_ints), I/F/B (lists, comma separated),
// Y (list of SymInts: integers, or s<index> into state_ints).
std::string encode_saved_data(const std::string& op_name,
                              const std::map<std::string, c10::IValue>& data,
                              std::vector<c10::SymInt>* state_ints);
bool is_symint_list(const c10::IValue& list);
// Raises encode_saved_data's error when an entry cannot be encoded.
void check_saved_data(const std::string& op_name,
                      const std::map<std::string, c10::IValue>& data);
std::map<std::string, c10::IValue> decode_saved_data(const std::string& state,
                                                     const std::vector<c10::SymInt>& ints);

} // namespace torch_opaque::detail
