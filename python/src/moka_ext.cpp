// moka._moka: the Python extension. Every call into moka's C++ API is in this file (the allocator
// moka calls back, over Python callables: python_allocator.hpp). Tensors arrive as DLPack
// capsules (zero-copy, no torch headers); outputs are allocated by the caller (torch's allocator)
// and passed in like inputs. A CUDA stream arrives as an integer.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>

#include "moka/distributed.hpp"
#include "moka/moka.hpp"
#include "python_allocator.hpp"

namespace nb = nanobind;
using namespace nb::literals;
using moka_python::PythonAllocator;

namespace {

using Array = nb::ndarray<>;
using OptionalArray = std::optional<Array>;

PyObject* g_error_type = nullptr;  // moka.Error, set by the module init

// A Python exception carrying the error's code and naming the rank that raised it; the message
// moka gives already names the input (and, across ranks, the rank that had the bad input).
struct RankedError {
  moka::ErrorCode code;
  std::string message;
};

// int64 only where moka takes it (the running expert load): elsewhere it stays a TypeError at the
// boundary, like any dtype moka does not compute in.
moka::DType dtype_of(const Array& a, const char* name, bool takes_int64) {
  const auto t = a.dtype();
  if (t == nb::dtype<float>()) return moka::DType::f32;
  if (t == nb::dtype<double>()) return moka::DType::f64;
  if (t == nb::dtype<int32_t>()) return moka::DType::i32;
  if (takes_int64 && t == nb::dtype<int64_t>()) return moka::DType::i64;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16 && t.lanes == 1) return moka::DType::bf16;
  static const char* codes[] = {"int", "uint", "float", "?", "bfloat"};
  const std::string kind = t.code < 5 ? codes[t.code] : "code " + std::to_string(t.code);
  throw nb::type_error((std::string(name) + " has dtype " + kind + std::to_string(t.bits) +
                        "; moka takes bfloat16, float32 or float64 (int32 or int64 for topk_ids)")
                           .c_str());
}

moka::TensorView view_of(const Array& a, const char* name, bool takes_int64 = false) {
  if (a.ndim() < 1 || a.ndim() > size_t(moka::kMaxRank))
    throw nb::value_error(
        (std::string(name) + " must have 1 to 4 dimensions, got " + std::to_string(a.ndim())).c_str());
  // A tensor without elements has no layout to check (an empty batch's gradient may come with
  // the zero strides of an expanded tensor).
  bool empty = false;
  for (size_t i = 0; i < a.ndim(); ++i) empty = empty || a.shape(i) == 0;
  int64_t expected_stride = 1;
  for (size_t i = a.ndim(); !empty && i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expected_stride)
      throw nb::value_error((std::string(name) + " is not contiguous; pass tensor.contiguous()").c_str());
    expected_stride *= int64_t(a.shape(i));
  }
  moka::TensorView v;
  v.data = a.data();
  v.dtype = dtype_of(a, name, takes_int64);
  if (a.device_type() == nb::device::cuda::value) {
    v.device = moka::Device::cuda(a.device_id());
  } else if (a.device_type() != nb::device::cpu::value) {
    throw nb::value_error((std::string(name) + " is on an unsupported device (CPU and CUDA only)").c_str());
  }
  v.rank = int(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) v.shape[i] = int64_t(a.shape(i));
  return v;
}

moka::TensorView view_of(const OptionalArray& a, const char* name, bool takes_int64 = false) {
  return a ? view_of(*a, name, takes_int64) : moka::TensorView{};
}

// The router's optional outputs for trainers that balance with auxiliary losses, and their gradients.
moka::RouterAuxOutputs aux_outputs(const OptionalArray& logits, const OptionalArray& probs,
                                   const OptionalArray& losses) {
  return {view_of(logits, "router_logits"), view_of(probs, "router_probs"), view_of(losses, "losses")};
}
moka::RouterAuxGradients aux_gradients(const OptionalArray& d_logits, const OptionalArray& d_probs,
                                       const OptionalArray& d_losses) {
  return {view_of(d_logits, "d_router_logits"), view_of(d_probs, "d_router_probs"), view_of(d_losses, "d_losses")};
}

moka::Stream stream_of(uintptr_t handle) { return moka::Stream{reinterpret_cast<void*>(handle)}; }

// Runs `body`, turning a moka::Error into a RankedError that names this rank. With a group,
// a failure before moka's own (collective) validation aborts the group, so the peers stop with
// an error naming this rank instead of waiting for a collective it will never join.
template <typename F>
auto on_rank(int rank, int size, moka::ProcessGroup* group, F&& body) {
  try {
    return body();
  } catch (const moka::Error& e) {
    throw RankedError{e.code(), "rank " + std::to_string(rank) + " of " + std::to_string(size) + ": " + e.what()};
  } catch (const nb::builtin_exception& e) {
    if (group) group->abort(e.what());
    throw;
  }
}

class Group {
 public:
  Group(int rank, int world_size, const std::string& master_addr, int master_port, double timeout_s,
        const std::string& job_key) {
    moka::Rendezvous r;
    r.rank = rank;
    r.world_size = world_size;
    r.master_addr = master_addr;
    r.master_port = master_port;
    r.timeout_seconds = timeout_s;
    r.job_key = job_key;
    group_ = on_rank(rank, world_size, nullptr, [&] { return moka::make_tcp_group(r); });
  }
  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }
  moka::ProcessGroup* get() const { return group_.get(); }

 private:
  std::unique_ptr<moka::ProcessGroup> group_;
};

// Where errors come from: this process's rank in its group (rank 0 of 1 without one).
struct RankScope {
  moka::ProcessGroup* group;
  int rank() const { return group ? group->rank() : 0; }
  int size() const { return group ? group->size() : 1; }
  template <typename F>
  auto run(F&& body) const {
    return on_rank(rank(), size(), group, std::forward<F>(body));
  }
};

// A forward's context, until a backward that consumes it.
moka::MoeContext& unconsumed(const std::unique_ptr<moka::MoeContext>& saved) {
  if (!saved)
    throw moka::Error(moka::ErrorCode::invalid_argument,
                      "this MoE call's saved state went to its first backward, which did not retain the graph");
  return *saved;
}

// The layer's backward of `saved`: with `consume` (a backward that will not run again: autograd
// without retain_graph) consume_backward, whose scratch reuses the saved gate and up and which
// leaves `saved` empty; else backward.
void layer_backward(moka::MoeLayer& layer, std::unique_ptr<moka::MoeContext>& saved, bool consume,
                    const moka::TensorView& d_out, const moka::MoeWeights& weights, const moka::MoeGradients& grads,
                    moka::Stream stream) {
  unconsumed(saved);
  if (consume) {
    layer.consume_backward(std::move(saved), d_out, weights, grads, stream);
  } else {
    layer.backward(*saved, d_out, weights, grads, stream);
  }
}

// LayerOptions as bound: moka's, and the Python object of its allocator, which the options and
// every layer or router made with them hold (moka's options only point to it).
struct LayerOptions : moka::LayerOptions {
  nb::object allocator_object;

  nb::object get_allocator() const { return allocator_object ? allocator_object : nb::none(); }
  void set_allocator(nb::handle value) {
    if (!value.is_none() && !nb::isinstance<PythonAllocator>(value))
      throw nb::type_error((std::string("LayerOptions.allocator must be a moka._moka.PythonAllocator or None, got ") +
                            nb::type_name(value.type()).c_str())
                               .c_str());
    allocator = value.is_none() ? nullptr : nb::inst_ptr<PythonAllocator>(value);
    allocator_object = value.is_none() ? nb::object() : nb::borrow(value);
  }
};

struct LayerContext {
  std::unique_ptr<moka::MoeContext> saved;
  std::vector<int64_t> local_expert_rows() const { return unconsumed(saved).local_expert_rows(); }
};

struct Weights {
  OptionalArray w_gate, w_up, w_down, ws_gate, ws_up, ws_down;
  moka::MoeWeights view() const {
    return {view_of(w_gate, "w_gate"),   view_of(w_up, "w_up"),   view_of(w_down, "w_down"),
            view_of(ws_gate, "ws_gate"), view_of(ws_up, "ws_up"), view_of(ws_down, "ws_down")};
  }
};

// The layer's gradients: d_x, d_topk_weights and the weights' gradients (as Weights).
moka::MoeGradients gradients_of(const Array& d_x, const Array& d_topk_weights, const Weights& d_weights) {
  const moka::MoeWeights g = d_weights.view();
  return {view_of(d_x, "d_x"),
          view_of(d_topk_weights, "d_topk_weights"),
          g.w_gate,
          g.w_up,
          g.w_down,
          g.ws_gate,
          g.ws_up,
          g.ws_down};
}

class Layer {
 public:
  friend class Moe;
  Layer(const moka::MoeShape& shape, const std::string& backend, Group* group, const LayerOptions& options)
      : on_rank_{group ? group->get() : nullptr}, allocator_(options.allocator_object) {
    layer_ = on_rank_.run(
        [&] { return moka::make_moe_layer(shape, moka::parse_backend(backend), on_rank_.group, options); });
  }

  std::unique_ptr<LayerContext> forward(const Array& x, const Array& topk_ids, const Array& topk_weights,
                                        const Weights& w, const Array& out, uintptr_t stream) {
    return on_rank_.run([&] {
      const moka::MoeInputs in{view_of(x, "x"), view_of(topk_ids, "topk_ids"), view_of(topk_weights, "topk_weights")};
      const moka::MoeWeights weights = w.view();
      const moka::TensorView out_view = view_of(out, "out");
      return std::make_unique<LayerContext>(LayerContext{layer_->forward(in, weights, out_view, stream_of(stream))});
    });
  }

  void backward(LayerContext& saved, const Array& d_out, const Weights& w, const Array& d_x,
                const Array& d_topk_weights, const Weights& grads, uintptr_t stream, bool consume) {
    on_rank_.run([&] {
      const moka::MoeWeights weights = w.view();
      const moka::MoeGradients gradients = gradients_of(d_x, d_topk_weights, grads);
      const moka::TensorView d_out_view = view_of(d_out, "d_out");
      layer_backward(*layer_, saved.saved, consume, d_out_view, weights, gradients, stream_of(stream));
    });
  }

  void check_errors() {
    on_rank_.run([&] { layer_->check_errors(); });
  }
  int rank() const { return layer_->rank(); }
  int world_size() const { return layer_->world_size(); }
  const char* backend() const { return layer_->backend_name(); }
  int64_t num_local_experts() const { return layer_->num_local_experts(); }
  int64_t first_local_expert() const { return layer_->first_local_expert(); }

 private:
  RankScope on_rank_;
  nb::object allocator_;  // before layer_: outlives the layer, which frees through it
  std::unique_ptr<moka::MoeLayer> layer_;
};

struct RouterContext {
  std::unique_ptr<moka::RouterContext> saved;
};

class Router {
 public:
  friend class Moe;
  Router(const moka::RouterConfig& config, const std::string& backend, Group* group, const LayerOptions& options)
      : on_rank_{group ? group->get() : nullptr}, allocator_(options.allocator_object) {
    router_ = on_rank_.run([&] { return moka::make_router(config, moka::parse_backend(backend), options); });
  }

  std::unique_ptr<RouterContext> forward(const Array& x, const Array& w_router, const OptionalArray& bias,
                                         const Array& topk_ids, const Array& topk_weights,
                                         const OptionalArray& expert_counts, const OptionalArray& expert_load,
                                         uintptr_t stream, const OptionalArray& router_logits,
                                         const OptionalArray& router_probs, const OptionalArray& losses) {
    return on_rank_.run([&] {
      const moka::RouterOutputs out{view_of(topk_ids, "topk_ids"), view_of(topk_weights, "topk_weights"),
                                    view_of(expert_counts, "expert_counts", true),
                                    view_of(expert_load, "expert_load", true),
                                    aux_outputs(router_logits, router_probs, losses)};
      const moka::TensorView x_view = view_of(x, "x"), w = view_of(w_router, "w_router");
      const moka::TensorView b = view_of(bias, "selection_bias");
      return std::make_unique<RouterContext>(RouterContext{router_->forward(x_view, w, b, out, stream_of(stream))});
    });
  }

  void backward(const RouterContext& saved, const Array& d_topk_weights, const Array& d_x, const Array& d_w_router,
                uintptr_t stream, bool add_to_d_x, const OptionalArray& d_router_logits,
                const OptionalArray& d_router_probs, const OptionalArray& d_losses) {
    on_rank_.run([&] {
      const moka::TensorView dw = view_of(d_topk_weights, "d_topk_weights"), dx = view_of(d_x, "d_x");
      const moka::TensorView dwr = view_of(d_w_router, "d_w_router");
      router_->backward(*saved.saved, dw, dx, dwr, stream_of(stream), add_to_d_x,
                        aux_gradients(d_router_logits, d_router_probs, d_losses));
    });
  }

 private:
  RankScope on_rank_;
  nb::object allocator_;  // before router_: outlives the router, which frees through it
  std::unique_ptr<moka::Router> router_;
};

class Moe;

// What one Moe.forward saved for its backward: the router's and the layer's contexts, and the
// arrays they point into but the caller does not keep: the routes (topk_ids, topk_weights), and
// the weights, so that backward needs none of them passed again. x is the caller's to keep
// (autograd's saved tensors release it after backward; holding it here would keep every layer's
// input alive for as long as its graph lives).
class MoeForward {
 public:
  MoeForward(const Moe& moe, moka::Stream stream) : moe_(moe), stream_(stream) {}
  // Writes every gradient: d_x, d_w_router and the expert weights' (the shared expert's where
  // it has one); d_topk_weights is scratch for the router's part.
  // d_router_logits, d_router_probs, d_losses: the gradients of the aux outputs the forward wrote.
  void backward(const Array& d_out, const Array& d_x, const Array& d_topk_weights, const Array& d_w_router,
                const Array& d_w_gate, const Array& d_w_up, const Array& d_w_down, const OptionalArray& d_ws_gate,
                const OptionalArray& d_ws_up, const OptionalArray& d_ws_down, bool consume,
                const OptionalArray& d_router_logits, const OptionalArray& d_router_probs,
                const OptionalArray& d_losses);

  Array w_router, topk_ids, topk_weights;
  OptionalArray bias;
  Weights weights;
  std::unique_ptr<moka::RouterContext> router_saved;
  std::unique_ptr<moka::MoeContext> layer_saved;

 private:
  const Moe& moe_;
  moka::Stream stream_;  // the forward's: the router frees its scratch in this stream's order
};

// The whole layer, routing through combine, as one call each way (what moka.torch.MoE runs):
// one crossing of the boundary per direction, and the router's part of x's gradient added to the
// experts' part inside the router's call.
class Moe {
 public:
  // release_gil: whether a call lets other Python threads run meanwhile (a choice measured by
  // bench/python_overhead.py: taking the GIL back after another thread held it costs a hand-off).
  Moe(Router& router, Layer& layer, bool release_gil) : router_(router), layer_(layer), release_gil_(release_gil) {}

  std::unique_ptr<MoeForward> forward(const Array& x, const Array& w_router, const OptionalArray& bias,
                                      const OptionalArray& expert_load, const Array& w_gate, const Array& w_up,
                                      const Array& w_down, const OptionalArray& ws_gate, const OptionalArray& ws_up,
                                      const OptionalArray& ws_down, const Array& topk_ids, const Array& topk_weights,
                                      const Array& out, uintptr_t stream, const OptionalArray& expert_counts,
                                      const OptionalArray& router_logits, const OptionalArray& router_probs,
                                      const OptionalArray& losses) const {
    std::optional<nb::gil_scoped_release> unlocked;
    if (release_gil_) unlocked.emplace();
    return layer_.on_rank_.run([&] {
      auto saved = std::make_unique<MoeForward>(*this, stream_of(stream));
      saved->w_router = w_router, saved->bias = bias;
      saved->topk_ids = topk_ids, saved->topk_weights = topk_weights;
      saved->weights = Weights{w_gate, w_up, w_down, ws_gate, ws_up, ws_down};
      const moka::TensorView x_view = view_of(x, "x"), ids = view_of(topk_ids, "topk_ids");
      const moka::TensorView weights = view_of(topk_weights, "topk_weights");
      const moka::RouterOutputs routes{ids, weights, view_of(expert_counts, "expert_counts", true),
                                       view_of(expert_load, "expert_load", true),
                                       aux_outputs(router_logits, router_probs, losses)};
      saved->router_saved = router_.router_->forward(x_view, view_of(w_router, "w_router"),
                                                     view_of(bias, "selection_bias"), routes, stream_of(stream));
      saved->layer_saved =
          layer_.layer_->forward({x_view, ids, weights}, saved->weights.view(), view_of(out, "out"), stream_of(stream));
      return saved;
    });
  }

  void backward(MoeForward& saved, moka::Stream stream, const Array& d_out, const Array& d_x,
                const Array& d_topk_weights, const Array& d_w_router, const Weights& d_weights, bool consume,
                const moka::RouterAuxGradients& aux) const {
    std::optional<nb::gil_scoped_release> unlocked;
    if (release_gil_) unlocked.emplace();
    layer_.on_rank_.run([&] {
      const moka::MoeGradients grads = gradients_of(d_x, d_topk_weights, d_weights);
      layer_backward(*layer_.layer_, saved.layer_saved, consume, view_of(d_out, "d_out"), saved.weights.view(), grads,
                     stream);
      router_.router_->backward(*saved.router_saved, grads.d_topk_weights, grads.d_x, view_of(d_w_router, "d_w_router"),
                                stream, /*add_to_d_x=*/true, aux);
    });
  }

 private:
  Router& router_;
  Layer& layer_;
  bool release_gil_;
};

void MoeForward::backward(const Array& d_out, const Array& d_x, const Array& d_topk_weights, const Array& d_w_router,
                          const Array& d_w_gate, const Array& d_w_up, const Array& d_w_down,
                          const OptionalArray& d_ws_gate, const OptionalArray& d_ws_up, const OptionalArray& d_ws_down,
                          bool consume, const OptionalArray& d_router_logits, const OptionalArray& d_router_probs,
                          const OptionalArray& d_losses) {
  moe_.backward(*this, stream_, d_out, d_x, d_topk_weights, d_w_router,
                Weights{d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down}, consume,
                aux_gradients(d_router_logits, d_router_probs, d_losses));
}

// The constructor of a bound options struct: the C++ defaults, then each keyword argument set
// as the attribute of that name (on a scratch instance: the one being built is not usable from
// Python until its __init__ returns), so every field is listed once (its def_rw) and Python code
// names what it sets. An unknown name or a value of the wrong type is a TypeError naming the field
// (a field whose default is None names the types it takes itself).
template <typename Options>
void keyword_init(Options* options, const nb::kwargs& fields) {
  nb::object scratch = nb::cast(Options{});
  for (auto [name, value] : fields) {
    const bool field =
        nb::hasattr(scratch.type(), name) && PyObject_TypeCheck(scratch.type().attr(name).ptr(), &PyProperty_Type);
    if (!field)
      throw nb::type_error((std::string(nb::type_name(scratch.type()).c_str()) +
                            "() got an unexpected keyword argument '" + nb::str(name).c_str() + "'")
                               .c_str());
    try {
      nb::setattr(scratch, name, value);
    } catch (const nb::python_error& e) {
      if (!e.matches(PyExc_TypeError) || scratch.attr(name).is_none()) throw;
      throw nb::type_error((std::string(nb::type_name(scratch.type()).c_str()) + "(): " + nb::str(name).c_str() + "=" +
                            nb::repr(value).c_str() + " is not a " + nb::type_name(scratch.attr(name).type()).c_str())
                               .c_str());
    }
  }
  new (options) Options(nb::cast<const Options&>(scratch));
}

// moka's configuration types (include/moka/config.hpp, layer.hpp, megakernel.hpp) as Python
// classes built with keyword arguments, e.g. LayerOptions(path=LayerPath.megakernel, max_tokens=4096);
// every field not given keeps its C++ default. Enums are Python enums named as in C++.
void bind_configuration(nb::module_& m) {
  nb::enum_<moka::Activation>(m, "Activation", "The experts' activation (MoeShape.activation).")
      .value("swiglu", moka::Activation::swiglu)
      .value("swiglu_clamped", moka::Activation::swiglu_clamped);
  nb::enum_<moka::ScoreFunction>(m, "ScoreFunction", "The router's score of a logit (RouterConfig.score).")
      .value("softmax", moka::ScoreFunction::softmax)
      .value("sigmoid", moka::ScoreFunction::sigmoid);
  nb::enum_<moka::LayerPath>(m, "LayerPath", "Which CUDA path a layer runs on (LayerOptions.path).")
      .value("automatic", moka::LayerPath::automatic)
      .value("single_gpu", moka::LayerPath::single_gpu)
      .value("all_to_all", moka::LayerPath::all_to_all)
      .value("megakernel", moka::LayerPath::megakernel);
  nb::enum_<moka::RowOrder>(m, "RowOrder", "The order of the sources' rows in an expert's segment.")
      .value("round_robin", moka::RowOrder::round_robin)
      .value("rate_based", moka::RowOrder::rate_based);
  nb::enum_<moka::SaveMode>(m, "SaveMode", "What a forward keeps for its backward (LayerOptions.save).")
      .value("gate_up", moka::SaveMode::gate_up)
      .value("none", moka::SaveMode::none);

  using moka::MoeShape;
  nb::class_<MoeShape>(m, "MoeShape", "An MoE layer's sizes and activation (moka::MoeShape).")
      .def("__init__", &keyword_init<MoeShape>)
      .def_rw("hidden", &MoeShape::hidden, "H")
      .def_rw("intermediate", &MoeShape::intermediate, "I, per routed expert")
      .def_rw("num_experts", &MoeShape::num_experts, "E, over all ranks")
      .def_rw("top_k", &MoeShape::top_k, "k, experts per token")
      .def_rw("shared_intermediate", &MoeShape::shared_intermediate, "Is; 0: no shared expert")
      .def_rw("activation", &MoeShape::activation)
      .def_rw("clamp_limit", &MoeShape::clamp_limit, "the clamp of swiglu_clamped");

  using moka::RouterConfig;
  nb::class_<RouterConfig>(m, "RouterConfig", "The router's sizes and routing rule (moka::RouterConfig).")
      .def("__init__", &keyword_init<RouterConfig>)
      .def_rw("hidden", &RouterConfig::hidden)
      .def_rw("num_experts", &RouterConfig::num_experts)
      .def_rw("top_k", &RouterConfig::top_k)
      .def_rw("score", &RouterConfig::score)
      .def_rw("use_selection_bias", &RouterConfig::use_selection_bias,
              "a per-expert bias added to the scores for the top-k selection only")
      .def_rw("renormalize", &RouterConfig::renormalize, "divide the k selected scores by their sum")
      .def_rw("route_scale", &RouterConfig::route_scale, "multiplies the route weights");

  // tile_rows and row_order are not bound: a layer takes them from LayerOptions.
  using moka::MegakernelConfig;
  nb::class_<MegakernelConfig>(m, "MegakernelConfig", "The megakernel path's knobs (moka::MegakernelConfig).")
      .def("__init__", &keyword_init<MegakernelConfig>)
      .def_rw("num_comm_sms", &MegakernelConfig::num_comm_sms, "CTAs doing dispatch and combine")
      .def_rw("minibatch_size", &MegakernelConfig::minibatch_size, "rows, the unit of overlap")
      .def_rw("macrobatch_size", &MegakernelConfig::macrobatch_size, "rows of the ring buffer")
      .def_rw("capacity_multiplier", &MegakernelConfig::capacity_multiplier,
              "the worst-case share of all routes landing on one rank")
      .def_rw("tile_n", &MegakernelConfig::tile_n, "gate|up GEMM N tile")
      .def_rw("down_tile_n", &MegakernelConfig::down_tile_n, "down GEMM N tile")
      .def_rw("band_row_tiles", &MegakernelConfig::band_row_tiles, "row tiles per band of a GEMM's tile order")
      .def_rw("spin_timeout_seconds", &MegakernelConfig::spin_timeout_seconds,
              "the bound of every in-kernel wait before it is reported as a timeout");

  nb::class_<PythonAllocator>(m, "PythonAllocator",
                              "Device memory for a layer's calls from Python callables (LayerOptions.allocator): "
                              "alloc(nbytes, stream) -> pointer, free(pointer, nbytes, stream), stream-ordered "
                              "like cudaMallocAsync / cudaFreeAsync (free's stream: the memory's last use); "
                              "an alloc that raises fails the call with moka.Error, one that returns 0 with "
                              "out of memory.")
      .def(nb::init<nb::object, nb::object>(), "alloc"_a, "free"_a)
      .def_prop_ro("alloc", &PythonAllocator::alloc)
      .def_prop_ro("free", &PythonAllocator::free);

  nb::class_<LayerOptions>(m, "LayerOptions", "How a layer runs (moka::LayerOptions).")
      .def("__init__", &keyword_init<LayerOptions>)
      .def_prop_rw("allocator", &LayerOptions::get_allocator, &LayerOptions::set_allocator,
                   nb::for_setter(nb::arg("allocator").none()),
                   "a PythonAllocator for each call's memory and what a forward saves; None: moka's pool")
      .def_rw("tile_rows", &LayerOptions::tile_rows, "each expert's rows are padded to a multiple")
      .def_rw("num_threads", &LayerOptions::num_threads, "CPU backend threads per rank; 0: all cores")
      .def_rw("row_order", &LayerOptions::row_order)
      .def_rw("fused_swiglu", &LayerOptions::fused_swiglu, "CUDA: SwiGLU in the gate GEMM's epilogue")
      .def_rw("path", &LayerOptions::path)
      .def_rw("save", &LayerOptions::save)
      .def_rw("max_tokens", &LayerOptions::max_tokens, "tokens per rank the megakernel path's buffers hold")
      .def_rw("megakernel", &LayerOptions::megakernel);
}

}  // namespace

NB_MODULE(_moka, m) {
  m.doc() = "moka's C++ MoE layer, router and process group (use moka.torch)";
  // Layers and their saved contexts are often still referenced when the interpreter exits
  // (moka.torch's caches, autograd graphs, a script's globals), and Python does not free those
  // before the extension: nanobind's leak report would print on every script's exit.
  nb::set_leak_warnings(false);
  m.attr("__commit__") = moka::build_commit();
  bind_configuration(m);
  m.def("cuda_available", &moka::cuda_backend_available, "Built with CUDA and a GPU is visible.");

  nb::enum_<moka::ErrorCode>(m, "ErrorCode", "What a moka.Error is about (moka.Error.code).")
      .value("invalid_argument", moka::ErrorCode::invalid_argument)
      .value("shape_mismatch", moka::ErrorCode::shape_mismatch)
      .value("expert_out_of_range", moka::ErrorCode::expert_out_of_range)
      .value("duplicate_expert", moka::ErrorCode::duplicate_expert)
      .value("non_finite", moka::ErrorCode::non_finite)
      .value("unsupported_size", moka::ErrorCode::unsupported_size)
      .value("capacity_exceeded", moka::ErrorCode::capacity_exceeded)
      .value("timeout", moka::ErrorCode::timeout)
      .value("peer_failure", moka::ErrorCode::peer_failure)
      .value("backend_unavailable", moka::ErrorCode::backend_unavailable)
      .value("cuda", moka::ErrorCode::cuda)
      .value("nccl", moka::ErrorCode::nccl)
      .value("io", moka::ErrorCode::io)
      .value("internal", moka::ErrorCode::internal);

  // Filled in by moka/__init__.py with moka.Error, whose instances carry `code`.
  m.def("_set_error_type", [](nb::handle type) { g_error_type = type.inc_ref().ptr(); });
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const RankedError& e) {
      nb::object error = nb::handle(g_error_type)(e.message, e.code);
      PyErr_SetObject(g_error_type, error.ptr());
    }
  });

  nb::class_<Group>(m, "Group", "moka's TCP process group (rank 0 listens on master_addr:master_port)")
      .def(nb::init<int, int, const std::string&, int, double, const std::string&>(), "rank"_a, "world_size"_a,
           "master_addr"_a, "master_port"_a, "timeout_s"_a = 60.0, "job_key"_a = "",
           nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("rank", &Group::rank)
      .def_prop_ro("size", &Group::size);

  nb::class_<Weights>(m, "Weights")
      .def(nb::init<OptionalArray, OptionalArray, OptionalArray, OptionalArray, OptionalArray, OptionalArray>(),
           "w_gate"_a.noconvert(), "w_up"_a.noconvert(), "w_down"_a.noconvert(), "ws_gate"_a.noconvert() = nb::none(),
           "ws_up"_a.noconvert() = nb::none(), "ws_down"_a.noconvert() = nb::none());

  nb::class_<LayerContext>(m, "LayerContext").def("local_expert_rows", &LayerContext::local_expert_rows);
  nb::class_<Layer>(m, "Layer", "moka's MoE layer (moka::MoeLayer): the experts for routed tokens.")
      .def(nb::init<const moka::MoeShape&, const std::string&, Group*, const LayerOptions&>(), "shape"_a, "backend"_a,
           "group"_a.none(), "options"_a = LayerOptions{}, nb::keep_alive<1, 4>())
      .def("forward", &Layer::forward, "x"_a.noconvert(), "topk_ids"_a.noconvert(), "topk_weights"_a.noconvert(),
           "weights"_a, "out"_a.noconvert(), "stream"_a, nb::keep_alive<0, 1>(),
           nb::call_guard<nb::gil_scoped_release>())
      .def("backward", &Layer::backward, "saved"_a, "d_out"_a.noconvert(), "weights"_a, "d_x"_a.noconvert(),
           "d_topk_weights"_a.noconvert(), "grads"_a, "stream"_a, "consume"_a = false,
           nb::call_guard<nb::gil_scoped_release>(),
           "consume: the saved state goes to this backward (its memory reused as scratch), none is run again.")
      .def("check_errors", &Layer::check_errors, nb::call_guard<nb::gil_scoped_release>(),
           "Raises the errors the GPU found in finished calls (after synchronizing the stream).")
      .def_prop_ro("rank", &Layer::rank)
      .def_prop_ro("world_size", &Layer::world_size)
      .def_prop_ro("backend", &Layer::backend)
      .def_prop_ro("num_local_experts", &Layer::num_local_experts)
      .def_prop_ro("first_local_expert", &Layer::first_local_expert);

  nb::class_<RouterContext>(m, "RouterContext");
  nb::class_<Router>(m, "Router", "moka's router (moka::Router): top-k routes from x.")
      .def(nb::init<const moka::RouterConfig&, const std::string&, Group*, const LayerOptions&>(), "config"_a,
           "backend"_a, "group"_a.none(), "options"_a = LayerOptions{}, nb::keep_alive<1, 4>())
      .def("forward", &Router::forward, "x"_a.noconvert(), "w_router"_a.noconvert(),
           "selection_bias"_a.noconvert().none(), "topk_ids"_a.noconvert(), "topk_weights"_a.noconvert(),
           "expert_counts"_a.noconvert().none(), "expert_load"_a.noconvert().none(), "stream"_a,
           "router_logits"_a.noconvert().none() = nb::none(), "router_probs"_a.noconvert().none() = nb::none(),
           "losses"_a.noconvert().none() = nb::none(), nb::keep_alive<0, 1>(), nb::call_guard<nb::gil_scoped_release>(),
           "Routes x; router_logits, router_probs [T, E] and losses [2] (balancing, z; no coefficients): optional "
           "outputs in the router's compute dtype (moka::RouterAuxOutputs).")
      .def("backward", &Router::backward, "saved"_a, "d_topk_weights"_a.noconvert(), "d_x"_a.noconvert(),
           "d_w_router"_a.noconvert(), "stream"_a, "add_to_d_x"_a = false,
           "d_router_logits"_a.noconvert().none() = nb::none(), "d_router_probs"_a.noconvert().none() = nb::none(),
           "d_losses"_a.noconvert().none() = nb::none(), nb::call_guard<nb::gil_scoped_release>(),
           "Writes d_w_router, and d_x (or adds to it with add_to_d_x); d_router_logits, d_router_probs, d_losses: "
           "the gradients of the aux outputs the forward wrote.");

  nb::class_<MoeForward>(m, "MoeForward", "What one Moe.forward saved for its backward.")
      .def("backward", &MoeForward::backward, "d_out"_a.noconvert(), "d_x"_a.noconvert(),
           "d_topk_weights"_a.noconvert(), "d_w_router"_a.noconvert(), "d_w_gate"_a.noconvert(), "d_w_up"_a.noconvert(),
           "d_w_down"_a.noconvert(), "d_ws_gate"_a.noconvert().none(), "d_ws_up"_a.noconvert().none(),
           "d_ws_down"_a.noconvert().none(), "consume"_a = false, "d_router_logits"_a.noconvert().none() = nb::none(),
           "d_router_probs"_a.noconvert().none() = nb::none(), "d_losses"_a.noconvert().none() = nb::none(),
           "Writes d_x and every weight's gradient (d_topk_weights: scratch), on the forward's stream; consume: "
           "the layer's saved state goes to this backward (its memory reused as scratch), none is run again.");
  nb::class_<Moe>(m, "Moe", "A router and a layer run as one call each way (routing through combine).")
      .def(nb::init<Router&, Layer&, bool>(), "router"_a, "layer"_a, "release_gil"_a = true, nb::keep_alive<1, 2>(),
           nb::keep_alive<1, 3>())
      .def("forward", &Moe::forward, "x"_a.noconvert(), "w_router"_a.noconvert(), "selection_bias"_a.noconvert().none(),
           "expert_load"_a.noconvert().none(), "w_gate"_a.noconvert(), "w_up"_a.noconvert(), "w_down"_a.noconvert(),
           "ws_gate"_a.noconvert().none(), "ws_up"_a.noconvert().none(), "ws_down"_a.noconvert().none(),
           "topk_ids"_a.noconvert(), "topk_weights"_a.noconvert(), "out"_a.noconvert(), "stream"_a,
           "expert_counts"_a.noconvert().none() = nb::none(), "router_logits"_a.noconvert().none() = nb::none(),
           "router_probs"_a.noconvert().none() = nb::none(), "losses"_a.noconvert().none() = nb::none(),
           nb::keep_alive<0, 1>(),
           "Routes x (adding the routes per expert to expert_load), runs the experts into out; expert_counts, "
           "router_logits, router_probs, losses: the router's optional outputs (Router.forward).");
}
