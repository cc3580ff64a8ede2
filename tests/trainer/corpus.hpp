// A small English-like corpus generated in-project for the trainer's tests: sentences from a
// tiny grammar, deterministic for a seed.
#pragma once

#include <cstdint>
#include <random>
#include <string>

namespace loom::trainer::test_corpus {

inline std::string generated_corpus(size_t bytes, uint64_t seed = 7) {
  static const char* subjects[] = {"the cat",       "a dog",       "my friend",   "the old sailor",
                                   "every student", "the machine", "our teacher", "a small bird"};
  static const char* verbs[] = {"sees",      "likes",  "finds",   "carries",
                                "remembers", "paints", "follows", "answers"};
  static const char* objects[] = {"the red ball",      "a long letter",   "the river",
                                  "seven apples",      "the quiet house", "a strange song",
                                  "the morning train", "her green hat"};
  static const char* tails[] = {".",          " today.",           " again.", " in the rain.",
                                " at night.", " with great care.", "!",       "?"};
  std::mt19937_64 rng(seed);
  std::string s;
  s.reserve(bytes + 64);
  int in_paragraph = 0;
  while (s.size() < bytes) {
    std::string sentence = std::string(subjects[rng() % 8]) + " " + verbs[rng() % 8] + " " +
                           objects[rng() % 8] + tails[rng() % 8];
    sentence[0] = static_cast<char>(sentence[0] - 'a' + 'A');
    s += sentence;
    if (++in_paragraph == 4) {
      s += "\n%\n";
      in_paragraph = 0;
    } else {
      s += " ";
    }
  }
  return s;
}

}  // namespace loom::trainer::test_corpus
