/* rlhost C ABI: everything. Plugins may include just the headers of the kinds they implement. */
#ifndef RLHOST_RLHOST_H_
#define RLHOST_RLHOST_H_

#include "rlhost/core.h"
#include "rlhost/tensor.h"
#include "rlhost/plugin.h"
#include "rlhost/algorithm.h"
#include "rlhost/backend.h"
#include "rlhost/comm.h"
#include "rlhost/dataset.h"
#include "rlhost/environment.h"
#include "rlhost/generator.h"
#include "rlhost/kernels.h"
#include "rlhost/model.h"
#include "rlhost/tokenizer.h"

#endif /* RLHOST_RLHOST_H_ */
