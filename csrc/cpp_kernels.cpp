#include <torch_opaque/detail/cpp_kernels.h>

#include <ATen/core/List.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <cstdio>
#include <sstream>
#include <unordered_map>

namespace torch_opaque::detail {
namespace {

bool aliases_any(const at::Tensor& t, const std::vector<at::Tensor>& others) {
  for (const auto& o : others) {
    if (o.defined() && t.is_alias_of(o)) return true;
  }
  return false;
}

std::string escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '_' || c == '-' || c == '.' || c == ' ') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::string double_text(double d) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", d);
  return buf;
}

template <class T, class F>
std::string join(const T& items, F f) {
  std::string out;
  bool first = true;
  for (const auto& x : items) {
    if (!first) out += ",";
    out += f(x);
    first = false;
  }
  return out;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  size_t start = 0;
  while (true) {
    size_t p = s.find(sep, start);
    out.push_back(s.substr(start, p - start));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  return out;
}

} // namespace

bool is_symint_list(const c10::IValue& v) {
  for (const c10::IValue& e : v.toListRef()) {
    if (!e.isInt() && !e.isSymInt()) return false;
  }
  return true;
}

std::string encode_saved_data(const std::string& op_name,
                              const std::map<std::string, c10::IValue>& data,
                              std::vector<c10::SymInt>* ints) {
  std::string out;
  for (const auto& [name, v] : data) {
    out += escape(name) + "=";
    if (v.isNone()) {
      out += "n:";
    } else if (v.isBool()) {
      out += std::string("b:") + (v.toBool() ? "1" : "0");
    } else if (v.isInt()) {
      out += "i:" + std::to_string(v.toInt());
    } else if (v.isSymInt()) {
      ints->push_back(v.toSymInt());
      out += "y:" + std::to_string(ints->size() - 1);
    } else if (v.isDouble()) {
      out += "f:" + double_text(v.toDouble());
    } else if (v.isString()) {
      out += "s:" + escape(v.toStringRef());
    } else if (v.isIntList()) {
      out += "I:" + join(v.toIntVector(), [](int64_t x) { return std::to_string(x); });
    } else if (v.isDoubleList()) {
      out += "F:" + join(v.toDoubleVector(), double_text);
    } else if (v.isList() && is_symint_list(v)) {
      std::string body;
      bool first = true;
      for (const c10::IValue& e : v.toListRef()) {
        if (!first) body += ",";
        first = false;
        if (e.isInt()) {
          body += std::to_string(e.toInt());
        } else {
          ints->push_back(e.toSymInt());
          body += "s" + std::to_string(ints->size() - 1);
        }
      }
      out += "Y:" + body;
    } else if (v.isBoolList()) {
      auto l = v.toBoolList();
      std::vector<bool> b(l.begin(), l.end());
      out += "B:" + join(b, [](bool x) { return std::string(x ? "1" : "0"); });
    } else {
      TORCH_CHECK(false, op_name, ": ctx.saved_data[\"", name, "\"] holds a ", v.tagKind(),
                  ", which cannot be passed to the backward op. Save tensors with "
                  "ctx.save_for_backward and keep ints, doubles, bools, strings, SymInts "
                  "or lists of ints/doubles/bools in saved_data.");
    }
    out += ";";
  }
  return out;
}

std::map<std::string, c10::IValue> decode_saved_data(const std::string& state,
                                                     const std::vector<c10::SymInt>& ints) {
  std::map<std::string, c10::IValue> data;
  for (const std::string& entry : split(state, ';')) {
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    TORCH_CHECK(eq != std::string::npos && entry.size() >= eq + 3 && entry[eq + 2] == ':',
                "torch_opaque: malformed saved_data entry '", entry, "'");
    const std::string name = unescape(entry.substr(0, eq));
    const char tag = entry[eq + 1];
    const std::string body = entry.substr(eq + 3);
    c10::IValue v;
    switch (tag) {
      case 'n': break;
      case 'b': v = body == "1"; break;
      case 'i': v = static_cast<int64_t>(std::stoll(body)); break;
      case 'y': v = ints.at(std::stoul(body)); break;
      case 'f': v = std::stod(body); break;
      case 's': v = unescape(body); break;
      case 'I': {
        std::vector<int64_t> l;
        for (const auto& x : split(body, ',')) l.push_back(std::stoll(x));
        v = l;
        break;
      }
      case 'F': {
        std::vector<double> l;
        for (const auto& x : split(body, ',')) l.push_back(std::stod(x));
        v = l;
        break;
      }
      case 'Y': {
        std::vector<c10::SymInt> l;
        for (const auto& x : split(body, ',')) {
          l.push_back(x[0] == 's' ? ints.at(std::stoul(x.substr(1))) : c10::SymInt(std::stoll(x)));
        }
        v = c10::IValue(c10::SymIntArrayRef(l));
        break;
      }
      case 'B': {
        c10::List<bool> l;
        for (const auto& x : split(body, ',')) l.push_back(x == "1");
        v = l;
        break;
      }
      default: TORCH_CHECK(false, "torch_opaque: unknown saved_data tag '", tag, "'");
    }
    data.emplace(name, std::move(v));
  }
  return data;
}

void finish_forward(const std::string& op_name, Context& ctx,
                    const std::vector<c10::IValue>& inputs, std::vector<at::Tensor> outputs,
                    bool recording, torch::jit::Stack* stack) {
  // Input tensors, with where they come from.
  std::vector<at::Tensor> input_tensors;
  std::unordered_map<const c10::TensorImpl*, SavedRef> refs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].isTensor()) {
      const at::Tensor& t = inputs[i].toTensor();
      input_tensors.push_back(t);
      refs.emplace(t.unsafeGetTensorImpl(), SavedRef{SavedKind::Input, (int64_t)i, 0});
    } else if (inputs[i].isTensorList()) {
      auto list = inputs[i].toTensorVector();
      for (size_t j = 0; j < list.size(); ++j) {
        input_tensors.push_back(list[j]);
        refs.emplace(list[j].unsafeGetTensorImpl(),
                     SavedRef{SavedKind::InputListItem, (int64_t)i, (int64_t)j});
      }
    }
  }
  // Operator outputs must not alias inputs or each other.
  for (size_t k = 0; k < outputs.size(); ++k) {
    TORCH_CHECK(outputs[k].defined(), op_name, ": forward returned an undefined tensor as output ",
                k, "; return a defined tensor.");
    std::vector<at::Tensor> earlier(outputs.begin(), outputs.begin() + k);
    if (aliases_any(outputs[k], input_tensors) || aliases_any(outputs[k], earlier)) {
      outputs[k] = outputs[k].clone();
    }
  }
  for (const auto& o : outputs) stack->emplace_back(o);
  c10::List<at::Tensor> residuals;
  if (!recording) {
    stack->emplace_back(std::move(residuals));
    return;
  }
  for (size_t k = 0; k < outputs.size(); ++k) {
    refs[outputs[k].unsafeGetTensorImpl()] = SavedRef{SavedKind::Output, (int64_t)k, 0};
  }
  ForwardRecord record;
  for (const at::Tensor& t : ctx.saved_tensors()) {
    if (!t.defined()) {
      record.saved.push_back({SavedKind::None, 0, 0});
      continue;
    }
    auto it = refs.find(t.unsafeGetTensorImpl());
    if (it != refs.end()) {
      record.saved.push_back(it->second);
      continue;
    }
    at::Tensor r = (aliases_any(t, input_tensors) || aliases_any(t, outputs)) ? t.clone() : t;
    SavedRef ref{SavedKind::Residual, (int64_t)residuals.size(), 0};
    refs[t.unsafeGetTensorImpl()] = ref;
    residuals.push_back(r);
    record.saved.push_back(ref);
  }
  if (!ctx.non_differentiable().empty()) {
    record.non_differentiable.assign(outputs.size(), false);
    for (const auto& nd : ctx.non_differentiable()) {
      for (size_t k = 0; k < outputs.size(); ++k) {
        if (nd.defined() && nd.is_same(outputs[k])) record.non_differentiable[k] = true;
      }
    }
  }
  record.materialize_grads = ctx.materialize_grads();
  record.state = encode_saved_data(op_name, ctx.saved_data, &record.state_ints);
  stack->emplace_back(std::move(residuals));
  set_forward_record(std::move(record));
}

std::pair<Context, std::vector<at::Tensor>> start_backward(torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 5);
  auto to_vec = [](const c10::IValue& v) {
    std::vector<at::Tensor> out;
    for (const auto& t : v.toOptionalTensorList()) {
      std::optional<at::Tensor> o = t;
      out.push_back(o.has_value() ? *o : at::Tensor());
    }
    return out;
  };
  std::vector<at::Tensor> saved = to_vec(args[0]);
  std::vector<at::Tensor> grads = to_vec(args[1]);
  auto needs_list = args[2].toBoolList();
  std::vector<bool> needs(needs_list.begin(), needs_list.end());
  std::map<std::string, c10::IValue> data =
      decode_saved_data(args[3].toStringRef(), args[4].toSymIntVector());
  torch::jit::drop(*stack, 5);
  Context ctx(std::move(needs));
  ctx.set_saved_tensors(std::move(saved));
  ctx.saved_data = std::move(data);
  return {std::move(ctx), std::move(grads)};
}

void finish_backward(const std::string& op_name, const std::vector<bool>& tensor_args,
                     std::vector<at::Tensor> grads, const Context& ctx,
                     const std::vector<at::Tensor>& grad_outputs, torch::jit::Stack* stack) {
  const size_t n = tensor_args.size();
  if (grads.size() > n) {
    for (size_t i = n; i < grads.size(); ++i) {
      TORCH_CHECK(!grads[i].defined(), op_name, ": backward returned ", grads.size(),
                  " gradients for ", n, " forward arguments.");
    }
    grads.resize(n);
  }
  TORCH_CHECK(grads.size() == n, op_name, ": backward returned ", grads.size(),
              " gradients, but forward takes ", n,
              " arguments. Return one gradient (an undefined at::Tensor() for none) per "
              "forward argument.");
  c10::List<std::optional<at::Tensor>> out;
  for (size_t i = 0; i < n; ++i) {
    at::Tensor g = grads[i];
    if (!g.defined()) {
      out.push_back(std::nullopt);
      continue;
    }
    TORCH_CHECK(tensor_args[i], op_name, ": backward returned a gradient for argument ", i,
                ", which is not a Tensor. Return an undefined at::Tensor() there.");
    if (aliases_any(g, ctx.saved_tensors()) || aliases_any(g, grad_outputs)) g = g.clone();
    out.push_back(g);
  }
  stack->emplace_back(std::move(out));
}

} // namespace torch_opaque::detail
