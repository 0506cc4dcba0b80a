// The C ABI between the IpuExecute kernel and the tf_ipu host runtime (Python, via ctypes).
//
//   IpuExecute kernel --(these two function pointers)--> ctypes trampolines --> tf_ipu runtime
//
// The op library links no libpython: the runtime registers two plain C callbacks at import
// time with tf_ipu_set_device_callbacks(), and the kernel calls them with raw buffers.
// Everything here is C (no C++ types) so that ctypes can describe it.
#ifndef TF_IPU_OPS_CC_KERNELS_IPU_DEVICE_CALLBACKS_H_
#define TF_IPU_OPS_CC_KERNELS_IPU_DEVICE_CALLBACKS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Registers a program (an IR module, `program_len` bytes) and its signature (UTF-8 JSON,
// `sig_len` bytes; neither is NUL-terminated) with the runtime. Returns a program id >= 0.
// On error returns a negative value and writes a NUL-terminated message of at most `err_len`
// bytes into `err`; if the value is -c with c a TF/absl status code (1..16) the kernel
// reports that code, otherwise INTERNAL. Called once per kernel instance and callback set.
typedef int64_t (*tf_ipu_register_fn)(const char* program, size_t program_len,
                                      const char* signature, size_t sig_len, char* err,
                                      size_t err_len);

// Runs a registered program. Inputs are read-only, outputs are already allocated (from the
// op's `output_shapes`) and must be filled by the runtime. Dtypes are TF DataType enum
// values; dims are all tensors' dims concatenated (tensor i has ranks[i] of them); a
// zero-size tensor may have a NULL pointer. Returns 0 (OK) or a TF/absl status code, with a
// NUL-terminated message in `err`. May be called from several threads at once.
typedef int (*tf_ipu_execute_fn)(int64_t program_id, int n_in, const void* const* in_ptrs,
                                 const int* in_dtypes, const int* in_ranks,
                                 const int64_t* in_dims, int n_out, void* const* out_ptrs,
                                 const int* out_dtypes, const int* out_ranks,
                                 const int64_t* out_dims, char* err, size_t err_len);

// Installs the callbacks (both non-NULL), or removes them (both NULL). Returns 0 on success,
// -1 if exactly one is NULL. Programs registered under earlier callbacks are registered
// again, lazily, under the new ones. The caller keeps the callbacks alive for as long as the
// process may run an IpuExecute op.
int tf_ipu_set_device_callbacks(tf_ipu_register_fn register_fn, tf_ipu_execute_fn execute_fn);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TF_IPU_OPS_CC_KERNELS_IPU_DEVICE_CALLBACKS_H_
