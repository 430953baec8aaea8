package api

import (
	"fmt"
	"regexp"
	"strings"
)

// TemplateRef is a parsed template reference: "name", "name:tag" or "name@sha256:<hex>".
type TemplateRef struct {
	Name   string
	Tag    string // empty when Digest is set
	Digest string // "sha256:<64 hex>"
}

var (
	refNameRe = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)
	refTagRe  = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)
	digestRe  = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)
)

// ParseTemplateRef parses and validates a template reference; a missing tag means "latest".
func ParseTemplateRef(s string) (TemplateRef, error) {
	if name, dg, ok := strings.Cut(s, "@"); ok {
		if !refNameRe.MatchString(name) || !digestRe.MatchString(dg) {
			return TemplateRef{}, fmt.Errorf("invalid template reference %q: want name@sha256:<64 hex digits>", s)
		}
		return TemplateRef{Name: name, Digest: dg}, nil
	}
	name, tag, ok := strings.Cut(s, ":")
	if !ok {
		tag = "latest"
	}
	if !refNameRe.MatchString(name) {
		return TemplateRef{}, fmt.Errorf("invalid template name %q: use lowercase letters, digits, '.', '_' or '-'", name)
	}
	if !refTagRe.MatchString(tag) {
		return TemplateRef{}, fmt.Errorf("invalid template tag %q", tag)
	}
	return TemplateRef{Name: name, Tag: tag}, nil
}

// ValidDigest reports whether d is "sha256:<64 hex>".
func ValidDigest(d string) bool { return digestRe.MatchString(d) }

// String returns the canonical form.
func (r TemplateRef) String() string {
	if r.Digest != "" {
		return r.Name + "@" + r.Digest
	}
	return r.Name + ":" + r.Tag
}
