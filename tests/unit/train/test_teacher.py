"""Teacher-forced samples: the target's states at every position as an unpadded forward gives them,
and a loss mask on the reply only."""
import pytest
import torch

from tide.train.offline import render_prompt
from tide.train.teacher import Conversation, conversation_ids, prompt_conversations, teacher_forced_samples
from tide.workloads.prompt import user_prompt


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from tide.models.tiny import tiny_llama_checkpoint

    return AutoTokenizer.from_pretrained(tiny_llama_checkpoint(tmp_path_factory.mktemp("tok") / "t"))


def test_states_equal_the_targets_own_forward_despite_padding(tiny_target):
    g = torch.Generator().manual_seed(0)
    lengths = [9, 23, 14, 31, 5]
    convs = [Conversation(ids=torch.randint(3, tiny_target.shape.vocab_size, (n,), generator=g).tolist(),
                          reply_start=n // 2) for n in lengths]
    samples = teacher_forced_samples(tiny_target, convs, batch_rows=3, pad_id=2, progress=False)
    assert [len(s) for s in samples] == lengths  # input order, unpadded
    for conv, s in zip(convs, samples):
        ids = torch.tensor([conv.ids])
        out = tiny_target.forward(ids, torch.tensor([0]), tiny_target.new_cache(1, len(conv.ids) + 1),
                                  torch.tensor([0]))
        assert s.tokens.tolist() == conv.ids
        torch.testing.assert_close(s.aux.float(), out.aux_hidden[0].bfloat16().float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(s.final.float(), out.final_hidden[0].bfloat16().float(), rtol=2e-2, atol=2e-2)
        expected = torch.zeros(len(conv.ids))
        expected[conv.reply_start:] = 1.0
        assert torch.equal(s.loss_mask, expected)


def test_reply_follows_the_served_prompt_and_ends_the_turn(tokenizer):
    messages = [{"role": "user", "content": "How do I make a cup of tea?"}]
    reply = "Boil the water, add the tea."
    conv = conversation_ids(tokenizer, messages, reply, 64, 200, end_ids=[2])
    prompt = render_prompt(tokenizer, messages, 64)
    assert conv.ids[:conv.reply_start] == prompt
    assert conv.ids[conv.reply_start:] == tokenizer.encode(reply, add_special_tokens=False) + [2]


def test_a_cut_reply_has_no_end_of_turn_and_empty_replies_are_dropped(tokenizer):
    messages = [{"role": "user", "content": "Tell me a joke."}]
    reply = "Why did the computer go to the doctor? It had a virus. " * 4
    conv = conversation_ids(tokenizer, messages, reply, 64, 10, end_ids=[2])
    assert conv.ids[conv.reply_start:] == tokenizer.encode(reply, add_special_tokens=False)[:10]
    assert conversation_ids(tokenizer, messages, "", 64, 10, end_ids=[2]) is None
    prompts = [user_prompt("a", "chat", "Hi", "Hello there."), user_prompt("b", "chat", "Hi again", None)]
    assert len(prompt_conversations(tokenizer, prompts, 64, 10, [2])) == 1
