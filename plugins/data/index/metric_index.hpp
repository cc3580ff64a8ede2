// Transitional: the trainer still includes "metric_index.hpp". The index format's declared
// header is <loom/data/metric_index.hpp>; delete this file once nothing includes it here.
#pragma once

#include <loom/data/metric_index.hpp>
