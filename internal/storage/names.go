package storage

import (
	"fmt"
	"strings"
)

// DigestPrefix starts every release digest.
const DigestPrefix = "sha256:"

// maxIDLen bounds sandbox ids; they become directory names and DNS labels.
const maxIDLen = 63

// ValidateID reports whether id is a valid sandbox id: 1 to 63 lowercase ASCII letters
// and digits.
func ValidateID(id string) error {
	if id == "" || len(id) > maxIDLen {
		return fmt.Errorf("storage: invalid sandbox id %q: want 1-%d characters", id, maxIDLen)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') {
			return fmt.Errorf("storage: invalid sandbox id %q: only lowercase letters and digits", id)
		}
	}
	return nil
}

// ValidateDigest reports whether d is a release digest: "sha256:" and 64 lowercase hex
// digits.
func ValidateDigest(d string) error {
	hex, ok := strings.CutPrefix(d, DigestPrefix)
	if !ok || len(hex) != 64 {
		return fmt.Errorf("storage: invalid digest %q: want sha256:<64 hex>", d)
	}
	for i := 0; i < len(hex); i++ {
		c := hex[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return fmt.Errorf("storage: invalid digest %q: want sha256:<64 hex>", d)
		}
	}
	return nil
}

// digestHex returns the hex part of a validated digest.
func digestHex(d string) (string, error) {
	if err := ValidateDigest(d); err != nil {
		return "", err
	}
	return strings.TrimPrefix(d, DigestPrefix), nil
}
