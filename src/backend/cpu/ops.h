// The CPU backend's non-matmul ops for the Step-3.5 forward pass, in one include. Each header states its
// ops' exact fp32 operation order: that text is the reference the CUDA backend must reproduce (D6).
// Matrix products live in backend/cpu/matmul.h.
#pragma once

#include "backend/cpu/ops_attention.h"
#include "backend/cpu/ops_elementwise.h"
#include "backend/cpu/ops_moe.h"
#include "backend/cpu/ops_norm.h"
#include "backend/cpu/ops_rope.h"
