// Package envdpb holds the protocol buffers of envd, the in-sandbox daemon the E2B
// SDKs talk to (services process.Process and filesystem.Filesystem), and the Go and
// Connect code generated from them. space-agent implements the services; the .pb.go
// files are committed so that building needs no protoc.
//
// To regenerate (protoc from Debian's protobuf-compiler, plugins with go install):
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.21.1
//	go generate ./internal/guest/envdpb
package envdpb

//go:generate protoc -I . --go_out=. --go_opt=paths=source_relative --connect-go_out=. --connect-go_opt=paths=source_relative process/process.proto filesystem/filesystem.proto
