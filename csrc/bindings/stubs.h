// The pickled form of an arena tensor, both ways: the C-level reducer_override that diverts a
// tensor into the arena and returns its stub, and the rebuild of a tensor from a stub's fields
// (which come from the message and are checked before they mean anything).
#pragma once

#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <cstdint>
#include <memory>

#include "bindings/tensor_arena.h"

namespace vllm_shm_arena {

/// Stub dtype strings ("bfloat16") -> dtypes; the package registers them once at import.
void register_stub_dtypes(const pybind11::dict& by_name);

/// The tensor a stub names, zero-copy, after checking every field (the errors a malformed stub
/// has always raised). vllm_shm_arena.arena._rebuild_arena_tensor.
at::Tensor rebuild_stub(TensorArenaReader& reader, pybind11::handle slot_idx,
                        pybind11::handle generation, pybind11::handle nbytes,
                        pybind11::handle dtype_str, pybind11::handle shape, pybind11::handle offset,
                        bool cuda_context);

/// A C-level reducer_override for one writer's pickler (see vllm_shm_arena/pickler.py for the
/// Python reference it mirrors); `diverted` collects (slot, generation) per diverted tensor.
/// `forward`: None, or (reader, ranks, arena name, rebuild, forwarded): a tensor lying in one
/// of `reader`'s holds (reader 0 of a counted arena) goes as a forward stub, rebuilt by
/// `rebuild(name, slot, generation, nbytes, dtype, shape, offset)`, counted with one forward
/// and listed in `forwarded`, while ranks 1..`ranks` of that arena are all attached.
pybind11::object make_reducer(std::shared_ptr<TensorArenaWriter> writer,
                              pybind11::object tensor_type, pybind11::object param_type,
                              pybind11::object rebuild_tensor, pybind11::object rebuild_param,
                              pybind11::dict dtype_names, uint64_t min_bytes,
                              pybind11::list diverted, pybind11::object forward);

}  // namespace vllm_shm_arena
