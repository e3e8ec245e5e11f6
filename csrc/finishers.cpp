// Note [One forward finisher] (include/torch_opaque/detail/finishers.h): what
// runs after a forward or a backward, for C++ ops and Python Functions alike.
#include <torch_opaque/detail/finishers.h>
#include <torch_opaque/detail/saved_data_codec.h>

#include <ATen/core/List.h>
#include <c10/util/SmallVector.h>
#include <c10/util/Exception.h>

#include <unordered_map>

namespace torch_opaque::detail {
namespace {

bool aliases_any(const at::Tensor& t, c10::ArrayRef<at::Tensor> others) {
  if (!t.has_storage()) return false;  // sparse tensors share no storage
  for (const auto& o : others) {
    if (o.defined() && o.has_storage() && t.is_alias_of(o)) return true;
  }
  return false;
}

// Note [Eager context state] for C++ ops: an eager call hands the backward
// the forward's ctx.saved_data as it is; a traced backward encodes it.
class SavedDataState final : public EagerState {
 public:
  explicit SavedDataState(std::map<std::string, c10::IValue> data) : data_(std::move(data)) {}
  void encode(std::string& state, std::vector<c10::SymInt>& state_ints,
              std::vector<at::Tensor>& /*saved*/) const override {
    // check_saved_data accepted every entry when the forward finished.
    state = encode_saved_data("torch_opaque", data_, &state_ints);
  }
  const std::map<std::string, c10::IValue>& data() const { return data_; }

 private:
  std::map<std::string, c10::IValue> data_;
};

} // namespace

void finish_forward(const std::string& op_name, Context& ctx,
                    c10::ArrayRef<c10::IValue> inputs, std::vector<at::Tensor> outputs,
                    bool recording, torch::jit::Stack* stack, bool list_output) {
  ForwardOutcome outcome;
  outcome.outputs = std::move(outputs);
  outcome.list_output = list_output;
  if (recording) {
    outcome.saved = ctx.saved_tensors();
    outcome.non_differentiable = ctx.non_differentiable();
    outcome.materialize_grads = ctx.materialize_grads();
    if (!ctx.saved_data.empty()) {
      check_saved_data(op_name, ctx.saved_data);  // errors at the forward, as when encoding
      outcome.eager_state = std::make_shared<SavedDataState>(std::move(ctx.saved_data));
    }
  }
  finish_forward(op_name, inputs, std::move(outcome), recording, stack);
}

void finish_forward(const std::string& op_name, c10::ArrayRef<c10::IValue> inputs,
                    ForwardOutcome outcome, bool recording, torch::jit::Stack* stack) {
  std::vector<at::Tensor>& outputs = outcome.outputs;
  // Input tensors, with where they come from. Ops have few tensors: a linear
  // search over a small inline vector beats a hash map.
  c10::SmallVector<at::Tensor, 8> input_tensors;
  c10::SmallVector<std::pair<const c10::TensorImpl*, SavedRef>, 8> refs;
  auto find_ref = [&](const c10::TensorImpl* p) -> SavedRef* {
    for (auto& r : refs) {
      if (r.first == p) return &r.second;
    }
    return nullptr;
  };
  auto add_ref = [&](const c10::TensorImpl* p, SavedRef ref) {
    if (!find_ref(p)) refs.emplace_back(p, ref);  // the first one wins
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].isTensor()) {
      const at::Tensor& t = inputs[i].toTensor();
      if (!t.defined()) continue;
      input_tensors.push_back(t);
      add_ref(t.unsafeGetTensorImpl(), SavedRef{SavedKind::Input, (int64_t)i, 0});
    } else if (inputs[i].isTensorList()) {
      auto list = inputs[i].toTensorList();
      for (size_t j = 0; j < list.size(); ++j) {
        at::Tensor t = list.get(j);
        add_ref(t.unsafeGetTensorImpl(),
                SavedRef{SavedKind::InputListItem, (int64_t)i, (int64_t)j});
        input_tensors.push_back(std::move(t));
      }
    }
  }
  // Which outputs are non-differentiable, by the tensors the forward returned
  // (before any copy below).
  std::vector<bool> non_diff;
  if (recording && !outcome.non_differentiable.empty()) {
    non_diff.assign(outputs.size(), false);
    for (const auto& nd : outcome.non_differentiable) {
      for (size_t k = 0; k < outputs.size(); ++k) {
        if (nd.defined() && nd.is_same(outputs[k])) non_diff[k] = true;
      }
    }
  }
  // Operator outputs must not alias inputs or each other.
  for (size_t k = 0; k < outputs.size(); ++k) {
    TORCH_CHECK(outputs[k].defined(), op_name, ": forward returned an undefined tensor as output ",
                k, "; return a defined tensor.");
    if (aliases_any(outputs[k], input_tensors) ||
        aliases_any(outputs[k], c10::ArrayRef<at::Tensor>(outputs.data(), k))) {
      outputs[k] = outputs[k].clone();
    }
  }
  if (outcome.list_output) {
    stack->emplace_back(c10::List<at::Tensor>(outputs));
  } else {
    for (const auto& o : outputs) stack->emplace_back(o);
  }
  c10::List<at::Tensor> residuals;
  if (!recording) {
    stack->emplace_back(std::move(residuals));
    return;
  }
  for (size_t k = 0; k < outputs.size(); ++k) {
    const c10::TensorImpl* p = outputs[k].unsafeGetTensorImpl();
    SavedRef ref{SavedKind::Output, (int64_t)k, 0};
    if (SavedRef* r = find_ref(p)) {
      *r = ref;
    } else {
      refs.emplace_back(p, ref);
    }
  }
  ForwardRecord record;
  record.saved.reserve(outcome.saved.size());
  for (const at::Tensor& t : outcome.saved) {
    if (!t.defined()) {
      record.saved.push_back({SavedKind::None, 0, 0});
      continue;
    }
    if (const SavedRef* r = find_ref(t.unsafeGetTensorImpl())) {
      record.saved.push_back(*r);
      continue;
    }
    // A residual: a `_fwd` output, so it must not alias the op's inputs or outputs.
    at::Tensor r =
        (aliases_any(t, input_tensors) || aliases_any(t, outputs)) ? t.clone() : t;
    SavedRef ref{SavedKind::Residual, (int64_t)residuals.size(), 0};
    refs.emplace_back(t.unsafeGetTensorImpl(), ref);
    residuals.push_back(r);
    record.saved.push_back(ref);
  }
  record.non_differentiable = std::move(non_diff);
  record.materialize_grads = outcome.materialize_grads;
  record.state = std::move(outcome.state);
  record.state_ints = std::move(outcome.state_ints);
  record.eager_state = std::move(outcome.eager_state);
  stack->emplace_back(std::move(residuals));
  set_forward_record(std::move(record));
}

BackwardArgs pop_backward_args(torch::jit::Stack* stack) {
  auto args = torch::jit::last(*stack, 5);
  auto to_vec = [](const c10::IValue& v) {
    std::vector<at::Tensor> out;
    const auto list = v.toOptionalTensorList();
    out.reserve(list.size());
    for (const auto& t : list) {
      std::optional<at::Tensor> o = t;
      out.push_back(o.has_value() ? std::move(*o) : at::Tensor());
    }
    return out;
  };
  BackwardArgs a;
  a.saved = to_vec(args[0]);
  a.grads = to_vec(args[1]);
  auto needs_list = args[2].toBoolList();
  a.needs_input_grad.assign(needs_list.begin(), needs_list.end());
  a.state = args[3].toStringRef();
  a.state_ints = args[4].toSymIntVector();
  torch::jit::drop(*stack, 5);
  return a;
}

BoxedKernel boxed_backward(DirectBackward direct) {
  return [direct = std::move(direct)](const c10::FunctionSchema& schema,
                                      torch::jit::Stack* stack) {
    const EagerState* eager = current_eager_state(schema);
    std::vector<at::Tensor> grads = direct(pop_backward_args(stack), eager);
    c10::List<std::optional<at::Tensor>> out;
    out.reserve(grads.size());
    for (at::Tensor& g : grads) {
      out.push_back(g.defined() ? std::optional<at::Tensor>(std::move(g)) : std::nullopt);
    }
    stack->emplace_back(std::move(out));
  };
}

Context backward_context(BackwardArgs& args, const EagerState* eager) {
  Context ctx(std::move(args.needs_input_grad));
  ctx.set_saved_tensors(std::move(args.saved));
  if (const auto* saved_data = dynamic_cast<const SavedDataState*>(eager)) {
    ctx.saved_data = saved_data->data();  // a copy: the node may run its backward again
  } else {
    ctx.saved_data = decode_saved_data(args.state, args.state_ints);
  }
  return ctx;
}

std::vector<at::Tensor> finish_backward(const std::string& op_name,
                                        const std::vector<bool>& tensor_args,
                                        std::vector<at::Tensor> grads,
                                        c10::ArrayRef<at::Tensor> saved,
                                        c10::ArrayRef<at::Tensor> grad_outputs) {
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
  for (size_t i = 0; i < n; ++i) {
    at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    TORCH_CHECK(tensor_args[i], op_name, ": backward returned a gradient for argument ", i,
                ", which is not a Tensor. Return an undefined at::Tensor() there.");
    // Note [Backward results do not alias]: `_bwd`'s results are the outputs
    // of an op, which may share storage neither with its inputs nor with each
    // other (torch's custom-op contract, checked by opcheck and AOTAutograd).
    if (aliases_any(g, saved) || aliases_any(g, grad_outputs) ||
        aliases_any(g, c10::ArrayRef<at::Tensor>(grads.data(), i))) {
      g = g.clone();
    }
  }
  return grads;
}

namespace {
// Not a valid Python or C++ identifier: no user key can collide with it.
constexpr const char* kListSizesKey = "torch_opaque:list_sizes";
} // namespace

void record_list_sizes(Context& ctx, c10::ArrayRef<c10::IValue> inputs) {
  std::vector<int64_t> sizes;
  for (const auto& v : inputs) {
    if (v.isTensorList()) sizes.push_back(static_cast<int64_t>(v.toTensorList().size()));
  }
  ctx.saved_data[kListSizesKey] = std::move(sizes);
}

std::vector<int64_t> take_list_sizes(Context& ctx) {
  auto it = ctx.saved_data.find(kListSizesKey);
  if (it == ctx.saved_data.end()) return {};
  std::vector<int64_t> sizes = it->second.toIntVector();
  ctx.saved_data.erase(it);
  return sizes;
}

std::vector<at::Tensor> flatten_gradients(const std::string& op_name,
                                          const std::vector<bool>& list_args,
                                          const std::vector<int64_t>& list_sizes,
                                          std::vector<Gradient> grads,
                                          std::vector<bool>* tensor_args) {
  const size_t n = list_args.size();
  for (size_t i = n; i < grads.size(); ++i) {
    TORCH_CHECK(grads[i].empty(), op_name, ": backward returned ", grads.size(),
                " gradients for ", n, " forward arguments.");
  }
  if (grads.size() > n) grads.resize(n);
  TORCH_CHECK(grads.size() == n, op_name, ": backward returned ", grads.size(),
              " gradients, but forward takes ", n,
              " arguments. Return one gradient (an undefined at::Tensor() for none) per "
              "forward argument.");
  std::vector<at::Tensor> flat;
  std::vector<bool> slots;
  size_t list = 0;
  for (size_t i = 0; i < n; ++i) {
    Gradient& g = grads[i];
    if (!list_args[i]) {
      TORCH_CHECK(!g.is_list(), op_name, ": backward returned a list of gradients for argument ",
                  i, ", which is not a Tensor[]. Return one at::Tensor there.");
      flat.push_back(g.tensor());
      slots.push_back((*tensor_args)[i]);
      continue;
    }
    TORCH_INTERNAL_ASSERT(list < list_sizes.size(), op_name, ": no recorded list sizes");
    const size_t len = static_cast<size_t>(list_sizes[list++]);
    TORCH_CHECK(g.is_list() || !g.tensor().defined(), op_name,
                ": backward returned one tensor for argument ", i,
                ", a Tensor[] of ", len, " elements. Return a std::vector<at::Tensor> with one "
                "gradient per element (undefined where an element gets none).");
    TORCH_CHECK(g.list().empty() || g.list().size() == len, op_name, ": backward returned ",
                g.list().size(), " gradients for argument ", i, ", a Tensor[] of ", len,
                " elements. Return one gradient per element (undefined where an element gets "
                "none), or an empty list for none at all.");
    for (size_t j = 0; j < len; ++j) {
      flat.push_back(g.list().empty() ? at::Tensor() : g.list()[j]);
      slots.push_back(true);
    }
  }
  *tensor_args = std::move(slots);
  return flat;
}

} // namespace torch_opaque::detail
