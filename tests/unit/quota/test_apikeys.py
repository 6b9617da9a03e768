"""API key format and hashing without Redis."""

from quota import apikeys


def test_formatted_key_parses_back_to_its_id() -> None:
    key_id, secret = apikeys.new_key_id(), apikeys.new_secret()
    plaintext = apikeys.format_key(key_id, secret)
    parsed = apikeys.parse_key(plaintext)
    assert parsed is not None and parsed.key_id == key_id and parsed.plaintext == plaintext
    assert plaintext.startswith(apikeys.visible_prefix(key_id) + "-")
    assert len(key_id) == 8


def test_malformed_keys_do_not_parse() -> None:
    good = apikeys.format_key("ab12cd34", "s" * 43)
    for bad in [None, 42, "", good[:-20], good.replace("sy-", "sk-"), "sy-AB12CD34-" + "s" * 43,
                good + "!", "sy-ab12cd3-" + "s" * 44]:  # fmt: skip
        assert apikeys.parse_key(bad) is None, bad


def test_hash_is_salted_and_checked_against_the_whole_plaintext() -> None:
    secret = apikeys.new_secret()
    plaintext = apikeys.format_key("ab12cd34", secret)
    salt_a, salt_b = apikeys.new_salt(), apikeys.new_salt()
    stored = apikeys.hash_key(salt_a, plaintext)
    assert stored != apikeys.hash_key(salt_b, plaintext)
    # The whole secret (a urlsafe secret may hold "-": its tail alone can be one
    # character, which a hex digest then contains by chance).
    assert secret not in stored
    assert apikeys.key_matches(salt_a, stored, plaintext)
    assert not apikeys.key_matches(salt_b, stored, plaintext)
    assert not apikeys.key_matches(salt_a, stored, plaintext[:-1] + "x")


def test_expiry_is_inclusive_and_none_never_expires() -> None:
    assert not apikeys.is_expired(None, 1e12)
    assert not apikeys.is_expired(100.0, 99.9)
    assert apikeys.is_expired(100.0, 100.0)
