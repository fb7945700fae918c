// HpdlStatus: the end of every hpdl.tensorflow graph node (see status_op.py for why it exists).
//
// `status` is the string the node's Python callback returned beside its outputs: empty when the collective
// succeeded (the values pass through, no copy), else "<code>:<message>" with a TensorFlow error code
// (9: FailedPrecondition, 3: InvalidArgument), which this kernel raises with that message.
#include <cstdlib>
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::tstring;

REGISTER_OP("HpdlStatus")
    .Input("status: string")
    .Input("values: T")
    .Output("outputs: T")
    .Attr("T: list(type) >= 0")
    .SetIsStateful()  // never pruned, folded or merged: it raises the collective's error
    .SetShapeFn([](::tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 1; i < c->num_inputs(); ++i) c->set_output(i - 1, c->input(i));
      return absl::OkStatus();
    });

class HpdlStatusOp : public OpKernel {
 public:
  explicit HpdlStatusOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const tstring& status = ctx->input(0).scalar<tstring>()();
    if (!status.empty()) {
      const std::string text(status.data(), status.size());
      const size_t colon = text.find(':');
      int code = colon == std::string::npos ? 0 : std::atoi(text.substr(0, colon).c_str());
      if (code <= 0 || code > 16) code = static_cast<int>(absl::StatusCode::kUnknown);
      ctx->SetStatus(absl::Status(static_cast<absl::StatusCode>(code),
                                  colon == std::string::npos ? text : text.substr(colon + 1)));
      return;
    }
    for (int i = 1; i < ctx->num_inputs(); ++i) ctx->set_output(i - 1, ctx->input(i));
  }
};

REGISTER_KERNEL_BUILDER(Name("HpdlStatus").Device(::tensorflow::DEVICE_CPU), HpdlStatusOp);

}  // namespace
