// The decode kernel's inner loop built for AVX2 (flags in CMakeLists.txt).

#define TORCHMHA_KERNEL_ISA avx2
#include "decode_kernel_impl.h"
