/* rlhost C ABI: tensors in DLPack's memory layout.
 *
 * These are our own definitions, laid out byte for byte like DLPack >= 1.1 (DLDevice, DLDataType,
 * DLTensor, DLPackVersion, DLManagedTensorVersioned), so a pointer to an rlh_tensor may be handed
 * to any DLPack consumer and back. Debian's dlpack package is 0.6, which lacks the fp8 codes and
 * the versioned managed tensor, hence our own copy of the layout. tests/abi checks the layout.
 * Unlike every other ABI struct these carry no struct_size: DLPack's layout is itself the
 * contract, versioned by rlh_pack_version.
 */
#ifndef RLHOST_TENSOR_H_
#define RLHOST_TENSOR_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Device types: DLPack's DLDeviceType values. */
#define RLH_DEVICE_CPU 1
#define RLH_DEVICE_CUDA 2
#define RLH_DEVICE_CUDA_HOST 3
#define RLH_DEVICE_CUDA_MANAGED 13

typedef struct rlh_device {
  int32_t device_type; /* RLH_DEVICE_* */
  int32_t device_id;   /* ordinal within the type; 0 for CPU */
} rlh_device;

/* Type codes: DLPack's DLDataTypeCode values (append-only there too). */
#define RLH_DTYPE_INT 0
#define RLH_DTYPE_UINT 1
#define RLH_DTYPE_FLOAT 2
#define RLH_DTYPE_OPAQUE_HANDLE 3
#define RLH_DTYPE_BFLOAT 4
#define RLH_DTYPE_COMPLEX 5
#define RLH_DTYPE_BOOL 6
#define RLH_DTYPE_FLOAT8_E3M4 7
#define RLH_DTYPE_FLOAT8_E4M3 8
#define RLH_DTYPE_FLOAT8_E4M3B11FNUZ 9
#define RLH_DTYPE_FLOAT8_E4M3FN 10
#define RLH_DTYPE_FLOAT8_E4M3FNUZ 11
#define RLH_DTYPE_FLOAT8_E5M2 12
#define RLH_DTYPE_FLOAT8_E5M2FNUZ 13
#define RLH_DTYPE_FLOAT8_E8M0FNU 14
#define RLH_DTYPE_FLOAT6_E2M3FN 15
#define RLH_DTYPE_FLOAT6_E3M2FN 16
#define RLH_DTYPE_FLOAT4_E2M1FN 17

typedef struct rlh_dtype {
  uint8_t code;   /* RLH_DTYPE_* */
  uint8_t bits;   /* 32 for float32, 16 for bfloat16, 8 for fp8 */
  uint16_t lanes; /* 1 unless vector-typed */
} rlh_dtype;

/* A non-owning view (DLTensor). Borrowed inputs are `const rlh_tensor*` valid for the call.
 * strides are in elements and never NULL when ndim > 0 (DLPack 1.2 rule). */
typedef struct rlh_tensor {
  void* data;
  rlh_device device;
  int32_t ndim;
  rlh_dtype dtype;
  int64_t* shape;   /* [ndim] */
  int64_t* strides; /* [ndim], elements */
  uint64_t byte_offset;
} rlh_tensor;

typedef struct rlh_pack_version {
  uint32_t major; /* 1 */
  uint32_t minor;
} rlh_pack_version;

#define RLH_PACK_VERSION_MAJOR 1
#define RLH_PACK_VERSION_MINOR 3

#define RLH_TENSOR_FLAG_READ_ONLY (1ull << 0)
#define RLH_TENSOR_FLAG_IS_COPIED (1ull << 1)

/* An owned tensor (DLManagedTensorVersioned): used when ownership changes hands. The consumer
 * calls deleter(self) exactly once when done; on a major version it does not know, it may only
 * call the deleter. */
typedef struct rlh_managed_tensor {
  rlh_pack_version version;
  void* manager_ctx;
  void (*deleter)(struct rlh_managed_tensor* self);
  uint64_t flags; /* RLH_TENSOR_FLAG_* */
  rlh_tensor dl_tensor;
} rlh_managed_tensor;

/* A tensor with a name: batch fields, model outputs, parameters. */
typedef struct rlh_named_tensor {
  const char* name; /* NUL-terminated, borrowed */
  rlh_tensor tensor;
} rlh_named_tensor;

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* RLHOST_TENSOR_H_ */
