// host/src/session.cpp and embed.cpp: instances created in dependency order and destroyed
// in reverse, references resolved to the live objects, state export/import, and the
// optimizer wrappers' numerics against a reference computed here.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "loom_test.hpp"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

class Session : public loom_test::ManifestTest {
 protected:
  loom_instance* find(const char* kind, const char* name) {
    loom_instance* out = nullptr;
    EXPECT_EQ(loom_find_instance(session_, kind, name, &out), LOOM_OK) << loom_last_error();
    return out;
  }
};

TEST_F(Session, CreatesDependenciesFirstAndDestroysInReverse) {
  // Declared before what it references; chains optimizer.main -> comm.b -> comm.c.
  ASSERT_EQ(open("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\ncomm = \"b\"\n\n"
                 "[comm.b]\nplugin = \"probe\"\npeer = \"c\"\n\n"
                 "[comm.c]\nplugin = \"probe\"\n"),
            LOOM_OK)
      << error_;
  probe_events* events = loom_test::probe_event_log(session_, "c");
  ASSERT_NE(events, nullptr);
  ASSERT_EQ(loom_instance_count(session_), 3U);
  EXPECT_STREQ(loom_instance_name(loom_instance_at(session_, 0)), "c");
  EXPECT_STREQ(loom_instance_name(loom_instance_at(session_, 1)), "b");
  EXPECT_STREQ(loom_instance_name(loom_instance_at(session_, 2)), "main");
  EXPECT_EQ(loom_instance_at(session_, 3), nullptr);
  loom_close(session_);
  session_ = nullptr;
  EXPECT_EQ(loom_test::take_events(events), "+c +b +main -main -b -c ");
}

TEST_F(Session, IndependentInstancesAreCreatedInFileOrder) {
  ASSERT_EQ(open("[optimizer.zeta]\nplugin = \"probe\"\ntag = \"z\"\n\n"
                 "[comm.world]\nplugin = \"probe\"\n\n"
                 "[optimizer.alpha]\nplugin = \"probe\"\ntag = \"a\"\n"),
            LOOM_OK)
      << error_;
  ASSERT_EQ(loom_instance_count(session_), 3U);
  EXPECT_STREQ(loom_instance_name(loom_instance_at(session_, 0)), "zeta");
  EXPECT_STREQ(loom_instance_name(loom_instance_at(session_, 1)), "world");
  EXPECT_STREQ(loom_instance_name(loom_instance_at(session_, 2)), "alpha");
}

TEST_F(Session, ReferencesResolveToTheLiveInstance) {
  ASSERT_EQ(open("[comm.world]\nplugin = \"probe\"\n\n"
                 "[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\ncomm = \"world\"\n"),
            LOOM_OK)
      << error_;
  loom_instance* comm = find("comm", "world");
  loom_instance* opt = find("loom.optimizer/1", "main");
  ASSERT_NE(comm, nullptr);
  ASSERT_NE(opt, nullptr);
  EXPECT_STREQ(loom_instance_kind(comm), "loom.comm/1");
  EXPECT_STREQ(loom_instance_kind(opt), "loom.optimizer/1");
  EXPECT_STREQ(loom_instance_plugin(opt), "probe");
  const auto* head = static_cast<const probe_object_head*>(loom_instance_object(opt));
  ASSERT_EQ(head->magic, PROBE_OBJECT_MAGIC);
  EXPECT_EQ(head->ref_instance, loom_instance_object(comm));
  EXPECT_EQ(head->ref_vtable, loom_instance_vtable(comm));

  // Stepping averages gradients through that comm: its counters show it.
  std::vector<float> a(5, 1.0F);
  std::vector<float> b(3, 1.0F);
  const std::vector<float> ga(5, 0.5F);
  const std::vector<float> gb(3, 0.25F);
  float* params[] = {a.data(), b.data()};
  const float* grads[] = {ga.data(), gb.data()};
  const int64_t numels[] = {5, 3};
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(loom_optimizer_step_f32(opt, params, grads, numels, 2, 1.0), LOOM_OK)
        << loom_last_error();
  }
  EXPECT_FLOAT_EQ(a[0], 0.0F);
  EXPECT_FLOAT_EQ(b[0], 0.5F);
  loom_optimizer_comm_info info{};
  info.struct_size = LOOM_OPTIMIZER_COMM_INFO_SIZE;
  ASSERT_EQ(loom_optimizer_get_comm_info(opt, &info), LOOM_OK) << loom_last_error();
  EXPECT_EQ(info.owns_communication, 1);
  EXPECT_EQ(info.rounds, 4U);
  EXPECT_EQ(info.bytes_sent, 2U * (5 + 3) * sizeof(float));
  // A caller with an older, smaller struct gets only its prefix.
  loom_optimizer_comm_info small{};
  small.struct_size = LOOM_STRUCT_SIZE(loom_optimizer_comm_info, bytes_sent);
  small.rounds = 77;
  ASSERT_EQ(loom_optimizer_get_comm_info(opt, &small), LOOM_OK) << loom_last_error();
  EXPECT_EQ(small.bytes_sent, info.bytes_sent);
  EXPECT_EQ(small.rounds, 77U);
}

TEST_F(Session, FailedCreateNamesThePlaceAndUndoesWhatWasCreated) {
  ASSERT_EQ(open("[comm.first]\nplugin = \"probe\"\n"), LOOM_OK) << error_;
  probe_events* events = loom_test::probe_event_log(session_, "first");
  ASSERT_NE(events, nullptr);
  loom_close(session_);
  session_ = nullptr;
  loom_test::take_events(events);

  EXPECT_EQ(open("[comm.a]\nplugin = \"probe\"\n\n[comm.b]\nplugin = \"probe\"\npeer = "
                 "\"a\"\nfail_create = true\n"),
            LOOM_ERR_FAILED_PRECONDITION);
  EXPECT_EQ(session_, nullptr);
  EXPECT_EQ(error_, at(4, 1) + "comm.b (plugin 'probe' (" +
                        loom_test::plugin_file("probe").string() +
                        ")): create failed: probe: comm 'b' fails as asked");
  EXPECT_EQ(loom_test::take_events(events), "+a -a ");
}

// A plugin that needs a newer host than this one refuses at create and names both versions
// (the host reads only the prefix of its structs it knows, so it could not tell by itself);
// validation, which runs no plugin code, still passes.
TEST_F(Session, APluginNeedingANewerHostRefusesNamingBothVersions) {
  EXPECT_EQ(check("[optimizer.o]\nplugin = \"newer_host\"\n"), LOOM_OK) << error_;
  EXPECT_EQ(open("[optimizer.o]\nplugin = \"newer_host\"\n"), LOOM_ERR_ABI_MISMATCH);
  EXPECT_EQ(session_, nullptr);
  const std::string need = "1." + std::to_string(LOOM_ABI_MINOR + 1);
  const std::string have = "1." + std::to_string(LOOM_ABI_MINOR);
  EXPECT_THAT(error_, HasSubstr("optimizer.o (plugin 'newer_host'")) << error_;
  EXPECT_THAT(error_, HasSubstr("needs a Loom host that speaks ABI " + need +
                                " or newer; this host speaks ABI " + have))
      << error_;
}

TEST_F(Session, ValidateOnlyCreatesNothing) {
  ASSERT_EQ(open("[comm.first]\nplugin = \"probe\"\n"), LOOM_OK) << error_;
  probe_events* events = loom_test::probe_event_log(session_, "first");
  ASSERT_NE(events, nullptr);
  loom_close(session_);
  session_ = nullptr;
  loom_test::take_events(events);
  EXPECT_EQ(check("[comm.a]\nplugin = \"probe\"\n"), LOOM_OK) << error_;
  EXPECT_EQ(loom_test::take_events(events), "");
}

TEST_F(Session, FindInstanceErrors) {
  ASSERT_EQ(open("[comm.world]\nplugin = \"probe\"\n"), LOOM_OK) << error_;
  loom_instance* out = nullptr;
  EXPECT_EQ(loom_find_instance(session_, "optimizer", "world", &out), LOOM_ERR_NOT_FOUND);
  EXPECT_EQ(loom_last_error(), "no loom.optimizer/1 instance named 'world' in " + file_.string());
  EXPECT_EQ(loom_find_instance(session_, nullptr, "nobody", &out), LOOM_ERR_NOT_FOUND);
  EXPECT_THAT(loom_last_error(), HasSubstr("'nobody'"));
  // router is a known kind since 1.4: not found, not an unknown kind.
  EXPECT_EQ(loom_find_instance(session_, "router", "world", &out), LOOM_ERR_NOT_FOUND);
  EXPECT_EQ(loom_last_error(), "no loom.router/1 instance named 'world' in " + file_.string());
  EXPECT_EQ(loom_find_instance(session_, "trainer", "world", &out), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("unknown kind 'trainer'"));
  EXPECT_EQ(loom_find_instance(session_, "", "world", &out), LOOM_OK);
  EXPECT_STREQ(loom_last_error(), "");
  // An optimizer call on a comm instance is refused, not dispatched through the wrong table.
  float p = 0;
  const float g = 0;
  float* params[] = {&p};
  const float* grads[] = {&g};
  const int64_t n = 1;
  EXPECT_EQ(loom_optimizer_step_f32(out, params, grads, &n, 1, 0.1), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("is a loom.comm/1 instance, not loom.optimizer/1"));
}

TEST_F(Session, InstanceParamsAreTheValidatedValuesWithTheirPlaces) {
  ASSERT_EQ(open("[comm.world]\nplugin = \"probe\"\n\n[optimizer.main]\nplugin = \"probe\"\n"
                 "tag = \"t\"\nstart_step = 5\ncomm = \"world\"\n"),
            LOOM_OK)
      << error_;
  char* raw = nullptr;
  ASSERT_EQ(loom_instance_params(session_, "optimizer", "main", &raw), LOOM_OK)
      << loom_last_error();
  const auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  EXPECT_EQ(doc["kind"], "loom.optimizer/1");
  EXPECT_EQ(doc["plugin"], "probe");
  EXPECT_EQ(doc["at"], at(4, 1).substr(0, at(4, 1).size() - 2));
  const auto& p = doc["params"];
  EXPECT_EQ(p["tag"]["value"], "t");
  EXPECT_EQ(p["start_step"]["value"], 5);
  EXPECT_EQ(p["start_step"]["at"], at(7, 1).substr(0, at(7, 1).size() - 2));
  EXPECT_EQ(p["comm"]["value"], "world");
  // Left out: the schema's default, and no place.
  EXPECT_EQ(p["maximize"]["value"], false);
  EXPECT_EQ(p["maximize"]["at"], "");
  EXPECT_EQ(p["labels"]["value"], nlohmann::json::array({"probe"}));
  EXPECT_EQ(p.size(), 9U);

  EXPECT_EQ(loom_instance_params(session_, "optimizer", "other", &raw), LOOM_ERR_NOT_FOUND);
  EXPECT_THAT(loom_last_error(), HasSubstr("declares no [optimizer.other]"));
  EXPECT_EQ(loom_instance_params(session_, "trainer", "main", &raw), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("unknown kind 'trainer'"));
}

TEST_F(Session, DeclaredInstancesAndOnlySomeSections) {
  const std::string text =
      "[comm.world]\nplugin = \"probe\"\n\n[optimizer.main]\nplugin = \"probe\"\n"
      "tag = \"a\"\ncomm = \"world\"\n\n[optimizer.spare]\nplugin = \"probe\"\ntag = \"b\"\n";
  ASSERT_EQ(open(text), LOOM_OK) << error_;
  char* raw = nullptr;
  ASSERT_EQ(loom_declared_instances(session_, "optimizer", &raw), LOOM_OK) << loom_last_error();
  auto doc = nlohmann::json::parse(raw);
  loom_free_string(raw);
  ASSERT_EQ(doc.size(), 2U);
  EXPECT_EQ(doc[0]["name"], "main");
  EXPECT_EQ(doc[1]["name"], "spare");
  EXPECT_EQ(doc[1]["section"], "optimizer");
  ASSERT_EQ(loom_declared_instances(session_, nullptr, &raw), LOOM_OK);
  EXPECT_EQ(nlohmann::json::parse(raw).size(), 3U);
  loom_free_string(raw);
  loom_close(session_);
  session_ = nullptr;

  // sections = "comm": the optimizers are left out unread, the comm is created, and its
  // place in messages is still its line in the file.
  loom_open_options o{};
  o.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  o.log_level = -1;
  o.sections = "comm";
  const std::string plugins = loom_test::plugin_dir().string();
  o.plugin_path = plugins.c_str();
  ASSERT_EQ(loom_open_string(text.c_str(), "m.toml", &o, &session_), LOOM_OK) << loom_last_error();
  EXPECT_EQ(loom_instance_count(session_), 1U);
  loom_instance* inst = nullptr;
  EXPECT_EQ(loom_find_instance(session_, "optimizer", "main", &inst), LOOM_ERR_NOT_FOUND);
  ASSERT_EQ(loom_instance_params(session_, "comm", "world", &raw), LOOM_OK);
  EXPECT_EQ(nlohmann::json::parse(raw)["at"], "m.toml:1:1");
  loom_free_string(raw);
  loom_close(session_);
  session_ = nullptr;
  // A section left out is not checked either: an unknown one no longer fails.
  const std::string odd = text + "\n[trainer.x]\nplugin = \"probe\"\n";
  EXPECT_EQ(loom_open_string(odd.c_str(), "m.toml", &o, &session_), LOOM_OK) << loom_last_error();
}

TEST_F(Session, StateRoundTrip) {
  ASSERT_EQ(open("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\nstart_step = 5\n"), LOOM_OK)
      << error_;
  loom_instance* opt = find("optimizer", "main");
  float p = 1.0F;
  const float g = 1.0F;
  float* params[] = {&p};
  const float* grads[] = {&g};
  const int64_t n = 1;
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(loom_optimizer_step_f32(opt, params, grads, &n, 1, 0.01), LOOM_OK);
  }
  size_t size = 0;
  ASSERT_EQ(loom_instance_export_state(opt, nullptr, 0, &size), LOOM_OK) << loom_last_error();
  ASSERT_EQ(size, sizeof(probe_state_blob));
  std::vector<unsigned char> small(size - 1);
  EXPECT_EQ(loom_instance_export_state(opt, small.data(), small.size(), &size),
            LOOM_ERR_OUT_OF_RANGE);
  EXPECT_THAT(loom_last_error(), HasSubstr("needs 24 bytes"));
  std::vector<unsigned char> blob(sizeof(probe_state_blob));
  ASSERT_EQ(loom_instance_export_state(opt, blob.data(), blob.size(), &size), LOOM_OK);
  probe_state_blob parsed{};
  std::memcpy(&parsed, blob.data(), sizeof parsed);
  EXPECT_EQ(std::memcmp(parsed.magic, PROBE_STATE_MAGIC, PROBE_STATE_MAGIC_BYTES), 0);
  EXPECT_EQ(parsed.steps, 8);

  // A fresh instance restored from it exports the same bytes.
  loom_test::TempDir other;
  auto r = loom_test::open_file(
      other.write("m.toml", "[optimizer.copy]\nplugin = \"probe\"\ntag = \"c\"\n"), false);
  ASSERT_EQ(r.rc, LOOM_OK) << r.error;
  loom_instance* copy = nullptr;
  ASSERT_EQ(loom_find_instance(r.session, "optimizer", "copy", &copy), LOOM_OK);
  ASSERT_EQ(loom_instance_import_state(copy, blob.data(), blob.size()), LOOM_OK)
      << loom_last_error();
  std::vector<unsigned char> again(blob.size());
  ASSERT_EQ(loom_instance_export_state(copy, again.data(), again.size(), &size), LOOM_OK);
  EXPECT_EQ(again, blob);

  // Foreign and corrupt blobs are refused with DATA_LOSS and leave the state unchanged.
  std::vector<unsigned char> foreign = blob;
  foreign[0] = 'X';
  EXPECT_EQ(loom_instance_import_state(copy, foreign.data(), foreign.size()), LOOM_ERR_DATA_LOSS);
  EXPECT_THAT(loom_last_error(), HasSubstr("optimizer.copy (plugin 'probe'"));
  EXPECT_THAT(loom_last_error(), HasSubstr("import_state: probe: foreign state (bad magic)"));
  EXPECT_EQ(loom_instance_import_state(copy, blob.data(), blob.size() - 1), LOOM_ERR_DATA_LOSS);
  const char text[] = "definitely not a probe state....";
  EXPECT_EQ(loom_instance_import_state(copy, text, sizeof(probe_state_blob)), LOOM_ERR_DATA_LOSS);
  ASSERT_EQ(loom_instance_export_state(copy, again.data(), again.size(), &size), LOOM_OK);
  EXPECT_EQ(again, blob);
  loom_close(r.session);
}

// The probe's update, computed independently: p -= lr * (g / grad_scale + wd * p).
void reference_step(std::vector<float>& p, const std::vector<float>& g, double lr, double wd,
                    double grad_scale) {
  for (size_t i = 0; i < p.size(); ++i) {
    const double pv = p[i];
    p[i] = static_cast<float>(pv - lr * (static_cast<double>(g[i]) / grad_scale + wd * pv));
  }
}

TEST_F(Session, StepF32MatchesTheReference) {
  ASSERT_EQ(open("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\nweight_decay = 0.1\n"),
            LOOM_OK)
      << error_;
  loom_instance* opt = find("optimizer", "main");
  std::vector<float> a(257);
  std::vector<float> b(31);
  std::vector<float> ga(a.size());
  std::vector<float> gb(b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = std::sin(static_cast<float>(i));
    ga[i] = std::cos(static_cast<float>(i) * 0.7F);
  }
  for (size_t i = 0; i < b.size(); ++i) {
    b[i] = static_cast<float>(i) - 15.0F;
    gb[i] = 0.125F * static_cast<float>(i % 5);
  }
  std::vector<float> ra = a;
  std::vector<float> rb = b;
  float* params[] = {a.data(), b.data()};
  const float* grads[] = {ga.data(), gb.data()};
  const int64_t numels[] = {static_cast<int64_t>(a.size()), static_cast<int64_t>(b.size())};
  for (int step = 0; step < 3; ++step) {
    const double lr = 0.05 / (step + 1);
    ASSERT_EQ(loom_optimizer_step_f32(opt, params, grads, numels, 2, lr), LOOM_OK)
        << loom_last_error();
    reference_step(ra, ga, lr, 0.1, 1.0);
    reference_step(rb, gb, lr, 0.1, 1.0);
  }
  for (size_t i = 0; i < a.size(); ++i) ASSERT_FLOAT_EQ(a[i], ra[i]) << "a[" << i << "]";
  for (size_t i = 0; i < b.size(); ++i) ASSERT_FLOAT_EQ(b[i], rb[i]) << "b[" << i << "]";
  EXPECT_NE(a, std::vector<float>(a.size()));  // something moved
}

TEST_F(Session, StepHonoursGroupsAndGradScale) {
  ASSERT_EQ(open("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\nweight_decay = 0.5\n"),
            LOOM_OK)
      << error_;
  loom_instance* opt = find("optimizer", "main");
  std::vector<float> p1{1.0F, -2.0F, 3.0F, 4.0F};
  std::vector<float> g1{0.5F, 0.5F, -1.0F, 2.0F};
  std::vector<float> p2{10.0F, 20.0F};
  std::vector<float> g2{4.0F, -4.0F};
  int64_t shape1[2] = {2, 2};
  int64_t shape2[1] = {2};
  const DLDataType f32{kDLFloat, 32, 1};
  DLTensor tp1{p1.data(), {kDLCPU, 0}, 2, f32, shape1, nullptr, 0};
  DLTensor tg1{g1.data(), {kDLCPU, 0}, 2, f32, shape1, nullptr, 0};
  DLTensor tp2{p2.data(), {kDLCPU, 0}, 1, f32, shape2, nullptr, 0};
  DLTensor tg2{g2.data(), {kDLCPU, 0}, 1, f32, shape2, nullptr, 0};
  const loom_optimizer_tensor t1{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp1, &tg1, nullptr};
  const loom_optimizer_tensor t2{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &tp2, &tg2, nullptr};
  const loom_optimizer_group groups[2] = {
      {LOOM_OPTIMIZER_GROUP_SIZE, 0, &t1, 1, 1.0, std::numeric_limits<double>::quiet_NaN()},
      {LOOM_OPTIMIZER_GROUP_SIZE, 0, &t2, 1, 0.5, 0.0}};
  const loom_optimizer_step_args args{
      LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups, 2, 0.1, 2.0, 1, nullptr};
  auto r1 = p1;
  auto r2 = p2;
  reference_step(r1, g1, 0.1, 0.5, 2.0);   // the instance's weight_decay
  reference_step(r2, g2, 0.05, 0.0, 2.0);  // lr_scale 0.5, weight_decay overridden to 0
  ASSERT_EQ(loom_optimizer_step(opt, &args), LOOM_OK) << loom_last_error();
  for (size_t i = 0; i < p1.size(); ++i) EXPECT_FLOAT_EQ(p1[i], r1[i]);
  for (size_t i = 0; i < p2.size(); ++i) EXPECT_FLOAT_EQ(p2[i], r2[i]);

  // Bad arguments change nothing: a half-precision gradient in the second group.
  const auto before1 = p1;
  const auto before2 = p2;
  tg2.dtype = DLDataType{kDLFloat, 16, 1};
  EXPECT_EQ(loom_optimizer_step(opt, &args), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("group 1 tensor 0: param and grad must be fp32"));
  EXPECT_EQ(p1, before1);
  EXPECT_EQ(p2, before2);
}

// An array listed twice in one step (the same pointer, or memory two entries share) would be
// updated twice; the host refuses it for every plugin before any runs, naming both entries.
TEST_F(Session, AnArrayListedTwiceInOneStepIsRefusedUnchanged) {
  ASSERT_EQ(open("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\n"), LOOM_OK) << error_;
  loom_instance* opt = find("optimizer", "main");
  std::vector<float> a{1.0F, 2.0F, 3.0F, 4.0F, 5.0F};
  std::vector<float> b{1.0F, 1.0F, 1.0F};
  const std::vector<float> g(5, 1.0F);
  const auto a0 = a, b0 = b;
  {
    float* params[] = {a.data(), b.data(), a.data()};
    const float* grads[] = {g.data(), g.data(), g.data()};
    const int64_t numels[] = {5, 3, 5};
    EXPECT_EQ(loom_optimizer_step_f32(opt, params, grads, numels, 3, 0.5),
              LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_THAT(loom_last_error(), StartsWith("optimizer.main ("));
    EXPECT_THAT(loom_last_error(), HasSubstr("): step: groups[0].tensors[0].param and "
                                             "groups[0].tensors[2].param are the same array "
                                             "(20 bytes)"));
    EXPECT_THAT(loom_last_error(), HasSubstr("nothing was updated"));
    EXPECT_EQ(a, a0);
    EXPECT_EQ(b, b0);
  }
  {
    // Two slices of one buffer that share elements 2..3.
    float* params[] = {a.data(), a.data() + 2};
    const float* grads[] = {g.data(), g.data()};
    const int64_t numels[] = {4, 3};
    EXPECT_EQ(loom_optimizer_step_f32(opt, params, grads, numels, 2, 0.5),
              LOOM_ERR_INVALID_ARGUMENT);
    EXPECT_THAT(loom_last_error(), HasSubstr("groups[0].tensors[0].param and "
                                             "groups[0].tensors[1].param overlap (8 bytes in "
                                             "common)"));
    EXPECT_EQ(a, a0);
  }
  // Across groups, through two DLTensors (one with explicit strides, one without), and a
  // master copy that is another tensor's param.
  int64_t shape[2] = {1, 3};
  int64_t strides[2] = {3, 1};
  const DLDataType f32{kDLFloat, 32, 1};
  DLTensor pb{b.data(), {kDLCPU, 0}, 2, f32, shape, nullptr, 0};
  DLTensor pb2{b.data(), {kDLCPU, 0}, 2, f32, shape, strides, 0};
  DLTensor gb{const_cast<float*>(g.data()), {kDLCPU, 0}, 2, f32, shape, nullptr, 0};
  const loom_optimizer_tensor t0{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &pb, &gb, nullptr};
  const loom_optimizer_tensor t1{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &pb2, &gb, nullptr};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  loom_optimizer_group groups[2] = {{LOOM_OPTIMIZER_GROUP_SIZE, 0, &t0, 1, 1.0, nan},
                                    {LOOM_OPTIMIZER_GROUP_SIZE, 0, &t1, 1, 1.0, nan}};
  const loom_optimizer_step_args args{
      LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups, 2, 0.5, 1.0, 1, nullptr};
  EXPECT_EQ(loom_optimizer_step(opt, &args), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("groups[0].tensors[0].param and "
                                           "groups[1].tensors[0].param are the same array"));
  EXPECT_EQ(b, b0);
  std::vector<uint16_t> half(3, 0);
  DLTensor ph{half.data(), {kDLCPU, 0}, 2, DLDataType{kDLFloat, 16, 1}, shape, nullptr, 0};
  const loom_optimizer_tensor mixed[2] = {{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &ph, &gb, &pb},
                                          {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &pb2, &gb, nullptr}};
  groups[0].tensors = mixed;
  groups[0].tensor_count = 2;
  const loom_optimizer_step_args one{
      LOOM_OPTIMIZER_STEP_ARGS_SIZE, 0, groups, 1, 0.5, 1.0, 1, nullptr};
  EXPECT_EQ(loom_optimizer_step(opt, &one), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("groups[0].tensors[0].master and "
                                           "groups[0].tensors[1].param are the same array"));
  EXPECT_EQ(b, b0);

  // Adjacent slices of one buffer, and interleaved strided views (every other element), share
  // no byte: they step (or reach the plugin, which takes contiguous tensors only).
  float* halves[] = {a.data(), a.data() + 2};
  const float* grads[] = {g.data(), g.data()};
  const int64_t numels[] = {2, 3};
  ASSERT_EQ(loom_optimizer_step_f32(opt, halves, grads, numels, 2, 0.5), LOOM_OK)
      << loom_last_error();
  EXPECT_EQ(a, (std::vector<float>{0.5F, 1.5F, 2.5F, 3.5F, 4.5F}));
  std::vector<float> c{1.0F, 2.0F, 3.0F, 4.0F};
  int64_t two = 2;
  int64_t every_other = 2;
  DLTensor even{c.data(), {kDLCPU, 0}, 1, f32, &two, &every_other, 0};
  DLTensor odd{c.data(), {kDLCPU, 0}, 1, f32, &two, &every_other, sizeof(float)};
  DLTensor g2{const_cast<float*>(g.data()), {kDLCPU, 0}, 1, f32, &two, nullptr, 0};
  const loom_optimizer_tensor views[2] = {{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &even, &g2, nullptr},
                                          {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &odd, &g2, nullptr}};
  groups[0].tensors = views;
  loom_optimizer_step_args strided = one;
  EXPECT_EQ(loom_optimizer_step(opt, &strided), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("probe: group 0 tensor 0: tensors must be contiguous"));
  // The same strided view twice is still the same array.
  const loom_optimizer_tensor twice[2] = {{LOOM_OPTIMIZER_TENSOR_SIZE, 0, &even, &g2, nullptr},
                                          {LOOM_OPTIMIZER_TENSOR_SIZE, 0, &even, &g2, nullptr}};
  groups[0].tensors = twice;
  EXPECT_EQ(loom_optimizer_step(opt, &strided), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("are the same array (12 bytes)"));
}

TEST_F(Session, ParametersReachThePlugin) {
  // maximize, signsgd and clip change the update; expect_numels checks sizes.
  ASSERT_EQ(open("[optimizer.main]\nplugin = \"probe\"\ntag = \"t\"\nmaximize = true\n"
                 "mode = \"signsgd\"\nclip = [-0.5, 0.5]\nexpect_numels = [3]\n"),
            LOOM_OK)
      << error_;
  loom_instance* opt = find("optimizer", "main");
  std::vector<float> p{0.0F, 0.0F, 0.0F};
  const std::vector<float> g{3.0F, -0.25F, 0.0F};
  float* params[] = {p.data()};
  const float* grads[] = {g.data()};
  int64_t n = 3;
  ASSERT_EQ(loom_optimizer_step_f32(opt, params, grads, &n, 1, 0.5), LOOM_OK) << loom_last_error();
  EXPECT_EQ(p, (std::vector<float>{0.5F, -0.5F, 0.0F}));
  n = 2;
  EXPECT_EQ(loom_optimizer_step_f32(opt, params, grads, &n, 1, 0.5), LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), HasSubstr("expect_numels"));
  EXPECT_EQ(p, (std::vector<float>{0.5F, -0.5F, 0.0F}));
}

TEST_F(Session, OpenStringWithOriginAndPluginPathOption) {
  loom_open_options opts{};
  opts.struct_size = LOOM_OPEN_OPTIONS_SIZE;
  const std::string dir = loom_test::plugin_dir().string();
  opts.plugin_path = dir.c_str();
  opts.log_level = LOOM_LOG_ERROR;
  loom_session* s = nullptr;
  const std::string origin = (dir_.path() / "inline.toml").string();
  ASSERT_EQ(loom_open_string("[comm.w]\nplugin = \"probe\"\n", origin.c_str(), &opts, &s), LOOM_OK)
      << loom_last_error();
  EXPECT_EQ(loom_instance_count(s), 1U);
  loom_close(s);
  s = nullptr;
  EXPECT_EQ(
      loom_open_string("[comm.w]\nplugin = \"probe\"\nbogus = 1\n", origin.c_str(), &opts, &s),
      LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s, nullptr);
  EXPECT_THAT(loom_last_error(), StartsWith(origin + ":3:1: unknown parameter 'bogus'"));
  EXPECT_EQ(loom_open_string("[comm.w]\nplugin = 1\n", nullptr, &opts, &s),
            LOOM_ERR_INVALID_ARGUMENT);
  EXPECT_THAT(loom_last_error(), StartsWith("<string>:2:10: "));
}

}  // namespace
