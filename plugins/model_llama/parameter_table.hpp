// Builds the parameter table of a description from an architecture row's weight-name patterns.
#pragma once

#include <vector>

#include "architecture_tables.hpp"
#include "rlhost/sdk/model_desc.hpp"

namespace rlh::model {

// Every parameter the description's layers need, in HF module order (embedding, layers, final
// norm, lm_head). Shapes follow from the description alone; names come from the row. Throws
// std::logic_error when the row lacks a pattern for a needed role (a table bug).
std::vector<sdk::ParamDesc> build_parameter_table(const sdk::TransformerDesc& desc,
                                                  const ArchitectureRow& row);

}  // namespace rlh::model
