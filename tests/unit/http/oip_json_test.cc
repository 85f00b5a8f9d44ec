// The HTTP/REST bodies of the Open Inference Protocol: JSON and binary tensors in, JSON and binary
// answers out, and the status-to-HTTP mapping.
#include "server/http/oip_json.h"

#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "attnserve/half.h"
#include "server/http/http_status.h"

namespace attnserve {
namespace {

Status Decode(std::string body, std::optional<size_t> header, inference::ModelInferRequest* out,
              HttpAnswerForm* form) {
  body.reserve(body.size() + 64);
  return HttpInferToOip(&body, header, "m", "", {}, out, form);
}

TEST(OipJsonTest, JsonDataBecomesTheRawBytesOfItsDatatype) {
  std::mt19937 rng(67);
  std::normal_distribution<float> normal;
  std::vector<float> values(12);
  for (float& v : values) v = normal(rng);
  nlohmann::json data = nlohmann::json::array();
  for (int r = 0; r < 3; ++r) {  // Nested, row-major.
    nlohmann::json row = nlohmann::json::array();
    for (int c = 0; c < 4; ++c) row.push_back(values[r * 4 + c]);
    data.push_back(row);
  }
  nlohmann::json body = {
      {"id", "x"},
      {"inputs",
       {{{"name", "query"}, {"datatype", "FP32"}, {"shape", {1, 3, 4}}, {"data", data}},
        {{"name", "key"}, {"datatype", "FP16"}, {"shape", {1, 3, 4}}, {"data", data}},
        {{"name", "key_padding_mask"},
         {"datatype", "BOOL"},
         {"shape", {1, 3}},
         {"data", {true, false, true}}}}},
      {"parameters", {{"is_causal", true}, {"binary_data_output", true}}}};
  inference::ModelInferRequest req;
  HttpAnswerForm form;
  ASSERT_TRUE(Decode(body.dump(), std::nullopt, &req, &form).ok());
  ASSERT_EQ(req.raw_input_contents_size(), 3);
  std::vector<float> fp32(12);
  std::memcpy(fp32.data(), req.raw_input_contents(0).data(), 48);
  EXPECT_EQ(fp32, values);  // JSON's doubles hold every float32 exactly.
  const std::string& fp16 = req.raw_input_contents(1);
  ASSERT_EQ(fp16.size(), 24u);
  for (int i = 0; i < 12; ++i) {
    uint16_t h = 0;
    std::memcpy(&h, fp16.data() + 2 * i, 2);
    EXPECT_EQ(h, FloatToHalf(values[i]));
  }
  EXPECT_EQ(req.raw_input_contents(2), std::string("\x01\x00\x01", 3));
  EXPECT_TRUE(req.parameters().at("is_causal").bool_param());
  EXPECT_EQ(req.parameters().count("binary_data_output"), 0u);  // HTTP's own, taken out.
  EXPECT_TRUE(form.Binary("attn_output"));
  EXPECT_EQ(req.id(), "x");
  EXPECT_EQ(req.model_name(), "m");
}

TEST(OipJsonTest, BinaryDataFollowsTheJsonInOrder) {
  const std::string header =
      R"({"inputs":[{"name":"query","datatype":"FP32","shape":[1,1,2],"parameters":{"binary_data_size":8}},)"
      R"({"name":"key","datatype":"FP32","shape":[1,1,1],"parameters":{"binary_data_size":4}}],)"
      R"("outputs":[{"name":"attn_output","parameters":{"binary_data":false}}]})";
  const std::string bytes = "AAAABBBBCCCC";
  inference::ModelInferRequest req;
  HttpAnswerForm form;
  ASSERT_TRUE(Decode(header + bytes, header.size(), &req, &form).ok());
  EXPECT_EQ(req.raw_input_contents(0), "AAAABBBB");
  EXPECT_EQ(req.raw_input_contents(1), "CCCC");
  EXPECT_FALSE(form.Binary("attn_output"));
  // One byte too many, or too few: refused, naming what is wrong.
  Status st = Decode(header + bytes + "D", header.size(), &req, &form);
  EXPECT_NE(st.message().find("1 bytes after the inputs' binary data"), std::string::npos)
      << st.message();
  req.Clear();
  st = Decode(header + "AAAA", header.size(), &req, &form);
  EXPECT_NE(st.message().find("inputs[0].parameters['binary_data_size']: 8 bytes"),
            std::string::npos)
      << st.message();
}

TEST(OipJsonTest, RefusalsNameTheField) {
  const auto refused = [](const std::string& body) {
    inference::ModelInferRequest req;
    HttpAnswerForm form;
    return Decode(body, std::nullopt, &req, &form).message();
  };
  EXPECT_NE(refused(R"({"inputs":[{"name":"query","datatype":"FP32","shape":[2],"data":[1,"a"]}]})")
                .find("inputs[0].data[1]: a string; expected a number for FP32"),
            std::string::npos);
  EXPECT_NE(refused(R"({"inputs":[{"name":"query","datatype":"FP32","shape":[3],"data":[1,2]}]})")
                .find("inputs[0].data: 2 values for shape [3]; expected 3"),
            std::string::npos);
  EXPECT_NE(refused(R"({"inputs":[{"name":"query","datatype":"FP32","shape":[-1],"data":[]}]})")
                .find("inputs[0].shape[0]: -1"),
            std::string::npos);
  EXPECT_NE(refused(R"({"inputs":[],"extra":1})").find("'extra' is not a field"),
            std::string::npos);
  // KServe's REST client names the model in the body as well: the path's, or refused.
  EXPECT_NE(refused(R"({"model_name":"other","inputs":[]})")
                .find("model_name: 'other', but the path names 'm'"),
            std::string::npos);
  EXPECT_EQ(refused(R"({"model_name":"m","model_version":"2","inputs":[]})"), "");
  EXPECT_NE(refused(std::string(1000, '[') + std::string(1000, ']')).find("deeper than 64"),
            std::string::npos);
  EXPECT_NE(refused("{\"inputs\":").find("not JSON"), std::string::npos);
  EXPECT_NE(refused(R"({"inputs":[{"name":"query","datatype":"FP32","shape":[1],)"
                    R"("parameters":{"binary_data_size":4}}]})")
                .find("no Inference-Header-Content-Length"),
            std::string::npos);
}

TEST(OipJsonTest, ValuesAreCountedAgainstTheShapeWhateverTheirNesting) {
  const auto refused = [](const std::string& shape, const std::string& data,
                          const char* datatype = "FP32") {
    inference::ModelInferRequest req;
    HttpAnswerForm form;
    return Decode(std::string(R"({"inputs":[{"name":"query","datatype":")") + datatype +
                      R"(","shape":)" + shape + R"(,"data":)" + data + "}]}",
                  std::nullopt, &req, &form)
        .message();
  };
  // More values than the shape holds, flat, nested, or past it only in a later row.
  EXPECT_NE(refused("[2]", "[1,2,3]").find("inputs[0].data: 3 values for shape [2]; expected 2"),
            std::string::npos);
  EXPECT_NE(refused("[2,2]", "[[1,2],[3,4,5]]").find("5 values for shape [2, 2]; expected 4"),
            std::string::npos);
  EXPECT_NE(refused("[4]", "[[1,2],[3,[4,[5]]]]").find("5 values for shape [4]; expected 4"),
            std::string::npos);
  EXPECT_NE(refused("[3]", "[[1],[]]").find("1 values for shape [3]; expected 3"),
            std::string::npos);
  EXPECT_NE(refused("[2]", "[true,false,true]", "BOOL").find("3 values for shape [2]"),
            std::string::npos);
  // A shape whose product no body of this size could hold is refused before any room is taken
  // for it (2^40 float32 would be 4 TiB), and an int64-overflowing one names its product.
  EXPECT_NE(refused("[1048576,1048576]", "[1,2]")
                .find("2 values for shape [1048576, 1048576]; expected 1099511627776"),
            std::string::npos);
  EXPECT_NE(refused("[4294967296,4294967296]", "[1]").find("expected their product"),
            std::string::npos);
  // A single value, not in an array, for a shape of one.
  EXPECT_EQ(refused("[1]", "7"), "");
  EXPECT_EQ(refused("[2,1]", "[[1],[2]]"), "");
}

TEST(OipJsonTest, AnswerNumbersReadBackAsTheSameFloat32) {
  std::mt19937 rng(68);
  std::vector<float> values(4096);
  for (float& v : values) {
    uint32_t bits = rng();
    std::memcpy(&v, &bits, 4);
    if (!std::isfinite(v)) v = 1.0f / 3.0f;
  }
  inference::ModelInferResponse head;
  head.set_model_name("m");
  head.set_model_version("1");
  auto* o = head.add_outputs();
  o->set_name("attn_output");
  o->set_datatype("FP32");
  o->add_shape(static_cast<int64_t>(values.size()));
  std::vector<AnswerBytes> raw(1);
  raw[0].own = std::make_unique<std::string>(reinterpret_cast<const char*>(values.data()),
                                             values.size() * 4);
  std::string json;
  std::vector<AnswerBytes> tail;
  std::optional<size_t> header;
  OipAnswerToHttp(head, std::move(raw), HttpAnswerForm{}, &json, &tail, &header);
  EXPECT_FALSE(header.has_value());
  const nlohmann::json j = nlohmann::json::parse(json);
  const auto& data = j["outputs"][0]["data"];
  ASSERT_EQ(data.size(), values.size());
  for (size_t i = 0; i < values.size(); ++i)
    ASSERT_EQ(static_cast<float>(data[i].get<double>()), values[i]) << i;
  EXPECT_EQ(j["outputs"][0]["shape"][0], 4096);  // An integer, not a string.
}

TEST(OipJsonTest, BinaryAnswerIsNotCopied) {
  inference::ModelInferResponse head;
  auto* o = head.add_outputs();
  o->set_name("attn_output");
  o->set_datatype("FP32");
  o->add_shape(2);
  std::vector<AnswerBytes> raw(1);
  raw[0].own = std::make_unique<std::string>(8, 'x');
  const char* bytes = raw[0].own->data();
  HttpAnswerForm form;
  form.binary_default = true;
  std::string json;
  std::vector<AnswerBytes> tail;
  std::optional<size_t> header;
  OipAnswerToHttp(head, std::move(raw), form, &json, &tail, &header);
  ASSERT_EQ(tail.size(), 1u);
  EXPECT_EQ(tail[0].own->data(), bytes);
  EXPECT_EQ(header, json.size());
  EXPECT_NE(json.find("\"binary_data_size\":8"), std::string::npos) << json;
}

TEST(HttpStatusTest, EveryCodeHasItsHttpCode) {
  EXPECT_EQ(ToHttpCode(StatusCode::kOk), 200);
  EXPECT_EQ(ToHttpCode(StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(ToHttpCode(StatusCode::kFailedPrecondition), 400);
  EXPECT_EQ(ToHttpCode(StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(ToHttpCode(StatusCode::kPermissionDenied), 403);
  EXPECT_EQ(ToHttpCode(StatusCode::kNotFound), 404);
  EXPECT_EQ(ToHttpCode(StatusCode::kAborted), 409);
  EXPECT_EQ(ToHttpCode(StatusCode::kAlreadyExists), 409);
  EXPECT_EQ(ToHttpCode(StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(ToHttpCode(StatusCode::kCancelled), 499);
  EXPECT_EQ(ToHttpCode(StatusCode::kUnavailable), 503);
  EXPECT_EQ(ToHttpCode(StatusCode::kDeadlineExceeded), 504);
  EXPECT_EQ(ToHttpCode(StatusCode::kInternal), 500);
}

}  // namespace
}  // namespace attnserve
