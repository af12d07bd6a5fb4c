package request

// KindOf says which API path names (its query string is ignored), without
// reading a body: the ext_proc server uses it to refuse a bodiless request
// to a path whose body Parse would require.
func KindOf(path string) Kind { return kindOf(path) }
