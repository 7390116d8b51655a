// Training rows from chat messages as NeMo-RL's get_formatted_message_log builds them
// (plugins/grpo/src/message_log.hpp), which the SFT, DPO and RM loops take their tokens and masks
// from: each message is what the template's rendering gains with it, tokenized on its own; BOS
// and EOS are added where missing; the assistant turn's header is trained on unless the
// generation prompt puts it in the user's turn. On a character-level tiny tokenizer (bos <s>,
// eos </s>) given a chat template of its own alphabet, so every token is visible.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>
#include <vector>

#include <nlohmann/json.hpp>

#include "components.hpp"
#include "message_log.hpp"
#include "rlhost/host.h"
#include "rlhost/sdk/status.hpp"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace rlh::grpo;

const fs::path kPlugins = RLH_PLUGIN_DIR;

struct MessageLog : ::testing::Test {
  void SetUp() override {
    if (!fs::exists(kPlugins / "libtokenizer_hf.so")) GTEST_SKIP() << "plugin 'tokenizer_hf' is not built";
    dir = fs::temp_directory_path() / ("rlh_message_log_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const std::string cmd = std::string(RLH_TINY_MODEL) + " " + dir.string() + " --alphabet '0123456789+=uas' > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    ASSERT_EQ(rlhost_create(&h), nullptr);
    rlhost_set_log_level(h, RLH_LOG_ERROR + 1);
    rlh::sdk::StatusPtr s(rlhost_load_plugin(h, (kPlugins / "libtokenizer_hf.so").c_str()));
    ASSERT_EQ(s.get(), nullptr) << rlh::sdk::status_message(s.get());
    host = rlh::sdk::Host(rlhost_services(h));
    raw = std::make_unique<Tokenizer>(host, dir.string());
    // A template in the alphabet: the role's initial, the content, </s> after each turn; the
    // generation prompt is the assistant's initial.
    json cfg = json::parse(std::ifstream(dir / "tokenizer_config.json"));
    cfg["chat_template"] =
        "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}a{% endif %}";
    std::ofstream(dir / "tokenizer_config.json") << cfg.dump(2);
    chat = std::make_unique<Tokenizer>(host, dir.string());
    ASSERT_TRUE(chat->has_chat_template());
    ASSERT_TRUE(chat->bos_token_id().has_value());
    ASSERT_FALSE(chat->eos_token_ids().empty());
  }
  void TearDown() override {
    chat.reset();
    raw.reset();
    if (h != nullptr) rlhost_destroy(h);
    if (!dir.empty()) fs::remove_all(dir);
  }
  std::vector<int32_t> ids(const std::string& text) const { return chat->encode(text, false); }

  fs::path dir;
  rlhost_t* h = nullptr;
  rlh::sdk::Host host;
  std::unique_ptr<Tokenizer> raw, chat;
  const json messages = json::array({{{"role", "user"}, {"content", "1+2="}}, {{"role", "assistant"}, {"content", "3"}}});
};

TEST_F(MessageLog, TheAssistantsHeaderIsTrainedUnlessTheGenerationPromptTakesIt) {
  const int32_t bos = *chat->bos_token_id(), eos = chat->eos_token_ids().front();
  MessageLogOptions o;  // NeMo-RL's sft.yaml: add_bos, add_eos, no generation prompt
  auto log = formatted_message_log(*chat, messages, o);
  ASSERT_EQ(log.size(), 2u);
  std::vector<int32_t> user = ids("u1+2=");
  user.insert(user.begin(), bos);  // the template starts without BOS: added
  user.push_back(eos);
  EXPECT_EQ(log[0], user);
  std::vector<int32_t> assistant = ids("a3");
  assistant.push_back(eos);  // ends with EOS already: none added
  EXPECT_EQ(log[1], assistant);
  std::vector<int32_t> row;
  std::vector<float> mask;
  message_log_row(log, messages, false, row, mask);
  ASSERT_EQ(row.size(), user.size() + assistant.size());
  for (size_t t = 0; t < row.size(); ++t) EXPECT_EQ(mask[t], t >= user.size() ? 1.0f : 0.0f) << "token " << t;

  o.add_generation_prompt = true;  // the header "a" goes with the user's turn, untrained
  log = formatted_message_log(*chat, messages, o);
  user.push_back(ids("a").front());
  EXPECT_EQ(log[0], user);
  assistant.erase(assistant.begin());
  EXPECT_EQ(log[1], assistant);

  o.add_bos = false;
  EXPECT_EQ(formatted_message_log(*chat, messages, o)[0], std::vector<int32_t>(user.begin() + 1, user.end()));
}

// policy.tokenizer.chat_template_kwargs reach every rendering as template variables (NeMo-RL
// binds them to apply_chat_template; Qwen3's enable_thinking is read this way).
TEST_F(MessageLog, TemplateKwargsReachTheTemplate) {
  json cfg = json::parse(std::ifstream(dir / "tokenizer_config.json"));
  cfg["chat_template"] =
      "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}</s>{% endfor %}"
      "{% if add_generation_prompt %}a{% if enable_thinking is defined and not enable_thinking %}ss{% endif %}{% endif %}";
  std::ofstream(dir / "tokenizer_config.json") << cfg.dump(2);
  Tokenizer t(host, dir.string());
  const json prompt = json::array({{{"role", "user"}, {"content", "1+2="}}});
  EXPECT_EQ(t.apply_chat_template(prompt, true), "u1+2=</s>a");
  t.set_template_kwargs(R"({"enable_thinking": false})");
  EXPECT_EQ(t.apply_chat_template(prompt, true), "u1+2=</s>ass");
  t.set_template_kwargs(R"({"enable_thinking": true})");
  EXPECT_EQ(t.apply_chat_template(prompt, true), "u1+2=</s>a");
}

TEST_F(MessageLog, WithoutATemplateTheContentsRunOnWithBosAndEos) {
  const int32_t bos = *raw->bos_token_id(), eos = raw->eos_token_ids().front();
  MessageLogOptions o;
  o.format = PromptFormat::kRaw;
  auto log = formatted_message_log(*raw, messages, o);
  ASSERT_EQ(log.size(), 2u);
  std::vector<int32_t> user = raw->encode("1+2=", false), answer = raw->encode("3", false);
  user.insert(user.begin(), bos);
  answer.push_back(eos);
  EXPECT_EQ(log[0], user);
  EXPECT_EQ(log[1], answer);
  o.add_bos = o.add_eos = false;
  log = formatted_message_log(*raw, messages, o);
  EXPECT_EQ(log[0], raw->encode("1+2=", false));
  EXPECT_EQ(log[1], raw->encode("3", false));
  // A prompt that starts with BOS's text and an answer that ends with EOS's get no second ones.
  o.add_bos = o.add_eos = true;
  const json has_both = json::array({{{"role", "user"}, {"content", "<s>1+2="}}, {{"role", "assistant"}, {"content", "3</s>"}}});
  log = formatted_message_log(*raw, has_both, o);
  EXPECT_EQ(log[0], user);
  EXPECT_EQ(log[1], answer);
  // DPO's mask: only the final message, when it is the assistant's.
  std::vector<int32_t> row;
  std::vector<float> mask;
  const json two = json::array({messages[0], messages[1], messages[0], messages[1]});
  message_log_row(formatted_message_log(*raw, two, o), two, true, row, mask);
  size_t trained = 0;
  for (float m : mask) trained += m > 0 ? 1 : 0;
  EXPECT_EQ(trained, answer.size());
  EXPECT_EQ(mask.back(), 1.0f);
}

// EOS is the tokenizer's own eos_token, as NeMo-RL's tokenizer.eos_token: a tokenizer without
// one adds none, though generation_config.json's stop ids still end generation.
TEST_F(MessageLog, EosIsTheTokenizersOwn) {
  json cfg = json::parse(std::ifstream(dir / "tokenizer_config.json"));
  cfg.erase("eos_token");
  cfg.erase("chat_template");
  std::ofstream(dir / "tokenizer_config.json") << cfg.dump(2);
  const Tokenizer none(host, dir.string());
  ASSERT_FALSE(none.eos_token_ids().empty()) << "generation_config.json's eos_token_id is a stop id";
  EXPECT_FALSE(none.eos_token_id().has_value());
  MessageLogOptions o;
  o.format = PromptFormat::kRaw;
  EXPECT_EQ(formatted_message_log(none, messages, o)[1], none.encode("3", false));
  EXPECT_EQ(raw->eos_token_id(), raw->eos_token_ids().front());
}

// A hostile row stays bounded: rendering stops once the tokens reach max_tokens (such a row is
// not trained on), and a conversation past kMaxConversationMessages is refused.
TEST_F(MessageLog, HostileRowsStayBounded) {
  MessageLogOptions o;
  o.format = PromptFormat::kRaw;
  json many = json::array();
  for (int i = 0; i < 512; ++i) {
    many.push_back({{"role", "user"}, {"content", "1+1="}});
    many.push_back({{"role", "assistant"}, {"content", "2"}});
  }
  o.max_tokens = 12;
  const auto log = formatted_message_log(*raw, many, o);
  size_t tokens = 0;
  for (const auto& m : log) tokens += m.size();
  EXPECT_GE(tokens, 12u);
  EXPECT_LT(log.size(), 8u) << "rendering went on past max_tokens";
  many.push_back({{"role", "user"}, {"content", "x"}});
  try {
    formatted_message_log(*raw, many, o);
    ADD_FAILURE() << "1025 messages were rendered";
  } catch (const rlh::sdk::Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than the 1024 a training row takes"), std::string::npos) << e.what();
  }
}

}  // namespace
