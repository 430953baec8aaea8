// Package ids owns the formats of space's identifiers. Sandbox ids are 20 lowercase
// base32 characters (letters and digits only: E2B host routing splits on '-' and '.');
// other ids carry a short type prefix so they are recognisable in logs.
package ids

import (
	"crypto/rand"
	"encoding/base32"
	"regexp"
	"strings"
)

var enc = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

func random(n int) string {
	b := make([]byte, (n*5+7)/8)
	if _, err := rand.Read(b); err != nil {
		panic("ids: crypto/rand failed: " + err.Error()) // the OS RNG never fails on Linux
	}
	return enc.EncodeToString(b)[:n]
}

var sandboxRe = regexp.MustCompile(`^[a-z0-9]{1,63}$`)

// Sandbox returns a new sandbox id.
func Sandbox() string { return random(20) }

// ValidSandbox reports whether s is a well-formed sandbox id.
func ValidSandbox(s string) bool { return sandboxRe.MatchString(s) }

// Operation returns a new operation id.
func Operation() string { return "op_" + random(20) }

// Session returns a new command session id.
func Session() string { return "ses_" + random(20) }

// APIKey returns a new API key id.
func APIKey() string { return "key_" + random(16) }

// Node returns a new node id.
func Node() string { return "n" + random(15) }

// Secret returns a random secret of n base32 characters.
func Secret(n int) string { return random(n) }

// ValidOperation reports whether s looks like an operation id.
func ValidOperation(s string) bool {
	return strings.HasPrefix(s, "op_") && sandboxRe.MatchString(s[3:])
}

// Snapshot returns a new named snapshot id: "snap" and 16 base32 characters, valid
// where a sandbox id is (it names a directory of the node's store).
func Snapshot() string { return "snap" + random(16) }
