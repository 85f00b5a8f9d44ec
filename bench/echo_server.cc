// attnserve-echo: the transport's own bound for attnserve-bench. An attnserve.v1 AttentionService
// whose Attend decodes the request as attnserve does and answers the query's bytes as the output
// (no validation, no compute), encoded as attnserve encodes answers (the bytes as a slice, no
// copy). What gRPC over loopback can carry at these message sizes, in the same run as the server.
//   attnserve-echo --address 127.0.0.1:50199
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "attnserve/v1/attention.grpc.pb.h"
#include "server/grpc/grpc_codec.h"

namespace {

class Echo final : public attnserve::v1::AttentionService::WithRawCallbackMethod_Attend<
                       attnserve::v1::AttentionService::Service> {
 public:
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                   grpc::ByteBuffer* resp) override {
    auto* reactor = ctx->DefaultReactor();
    attnserve::v1::AttendRequest request;
    const attnserve::Status st = attnserve::ParseRequest(*req, &request);
    if (!st.ok()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, st.message()));
      return reactor;
    }
    attnserve::v1::AttendResponse meta;
    meta.set_request_id(request.request_id());
    meta.mutable_output()->set_dtype(request.query().dtype());
    *meta.mutable_output()->mutable_shape() = request.query().shape();
    attnserve::AnswerBytes out;
    out.own = std::make_unique<std::string>(std::move(*request.mutable_query()->mutable_data()));
    *resp = attnserve::EncodeResponse(meta, std::move(out), nullptr);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attnserve-echo: Attend answered with the query's bytes (the transport's bound)"};
  std::string address = "127.0.0.1:50199";
  int max_message = 1 << 30;
  std::vector<std::string> grpc_args;
  app.add_option("--address", address, "Listen address")->capture_default_str();
  app.add_option("--grpc-arg", grpc_args, "A gRPC channel argument NAME=INTEGER (repeatable)");
  CLI11_PARSE(app, argc, argv);
  Echo service;
  grpc::ServerBuilder builder;
  for (const std::string& a : grpc_args) {
    const size_t eq = a.find('=');
    if (eq == std::string::npos) {
      std::cerr << "attnserve-echo: --grpc-arg " << a << ": expected NAME=INTEGER\n";
      return 2;
    }
    builder.AddChannelArgument(a.substr(0, eq), std::atoi(a.c_str() + eq + 1));
  }
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(max_message);
  builder.SetMaxSendMessageSize(max_message);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "attnserve-echo: cannot listen on " << address << "\n";
    return 2;
  }
  std::cout << "attnserve-echo: serving on " << address.substr(0, address.rfind(':')) << ":" << port
            << std::endl;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  int sig = 0;
  sigwait(&set, &sig);
  server->Shutdown();
  return 0;
}
