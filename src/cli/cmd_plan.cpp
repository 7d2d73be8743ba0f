// `memra plan [MODEL_DIR] --tp N`: the parallel layout of a model over ranks (routed experts always whole,
// expert-parallel over the TP ranks).
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "model/step35_config.h"
#include "model/step35_plan.h"
#include "parallel/plan.h"

namespace memra::cli {

Command add_plan_command(CLI::App &app) {
    auto model_dir = std::make_shared<std::string>();
    auto req = std::make_shared<parallel::PlanRequest>();
    auto devices = std::make_shared<int>(0);

    CLI::App *sub = app.add_subcommand(
        "plan", "Show the tensor/expert/pipeline-parallel layout of a model (heads, K blocks, experts per rank)");
    add_model_dir_option(*sub, *model_dir);
    sub->add_option("-t,--tp,--tensor-parallel-size", req->tp, "Tensor-parallel ranks per pipeline stage")
        ->envname("MEMRA_TP")
        ->capture_default_str();
    sub->add_option("--pp,--pipeline-parallel-size", req->pipeline_stages, "Pipeline stages")
        ->envname("MEMRA_PP")
        ->capture_default_str();
    // Positive when given: 0 is not "the default" (that would silently accept a bad value).
    sub->add_option("--devices", *devices, "Devices available (default: exactly the ranks the plan needs)")
        ->envname("MEMRA_DEVICES")
        ->check(positive_int_validator());

    return {sub, [model_dir, req, devices]() {
                const std::filesystem::path dir = resolve_model_dir(*model_dir);
                if (dir.empty()) return kExitInvalidInput;
                auto cfg = model::load_step35_config(dir);
                if (!cfg) return report_error(cfg.error().message);
                parallel::PlanRequest request = *req;
                request.devices_available = *devices > 0 ? *devices : request.pipeline_stages * request.tp;
                const parallel::ModelShape shape = model::plan_shape(*cfg);
                auto plan = parallel::make_plan(shape, request);
                if (!plan) return report_error(fmt::format("cannot plan {}: {}", dir.string(), plan.error().message));
                std::fputs(parallel::format_plan(*plan, shape).c_str(), stdout);
                return kExitOk;
            }};
}

}  // namespace memra::cli
