// Registers a no-op CUDA device guard so FakeTensorMode can index "cuda" tensors on a CPU-only torch.
#include <c10/core/impl/DeviceGuardImplInterface.h>
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
